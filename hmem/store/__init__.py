"""The store engine: the Store facade and the components that own its state,
write path, search, eviction and compaction (docs/architecture.md)."""
