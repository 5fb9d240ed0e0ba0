"""Prefect flows: the DAG, read top to bottom."""
