"""Overlap detection: exact dedup within the corpus and n-gram contamination against benchmark test sets."""
