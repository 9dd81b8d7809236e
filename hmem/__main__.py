"""``python -m hmem`` runs the command line."""

from hmem.cli import main

main()
