"""Lineage: content-addressed artifacts, per-artifact lineage records and the document ledger."""
