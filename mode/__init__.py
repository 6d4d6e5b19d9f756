"""mode: Mixture-of-Depths-and-Experts language models on DeepSpeed."""
__version__ = "0.1.0"
