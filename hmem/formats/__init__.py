"""The on-disk formats of a store, one module per file type (docs/format.md)."""
