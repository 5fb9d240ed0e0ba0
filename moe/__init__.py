"""The dropless Mixture-of-Experts model.

Router, experts, losses, layer, transformer, training and evaluation.
"""
