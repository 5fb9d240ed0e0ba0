"""The dropless Mixture-of-Experts model: router, experts, losses, layer, transformer, training and evaluation."""
