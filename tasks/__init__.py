"""Prefect tasks: thin wrappers that give each stage its cache key, lineage record and atomic commit."""
