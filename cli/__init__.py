"""The `moeflow` command: the argument parser and commands (`main.py`) and the local Prefect stack (`stack.py`)."""

from moeflow.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
