"""K/V files in and out of a store: batch import and export (docs/cli.md)."""
