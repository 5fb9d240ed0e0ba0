"""moeflow: raw text to a trained dropless Mixture-of-Experts model, with its whole lineage attached."""

__version__ = "0.1.0"
