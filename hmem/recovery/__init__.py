"""Checking and repairing stores: verify and repair (docs/reliability.md)."""
