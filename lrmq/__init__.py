"""lrmq: quantize and RL-train large reasoning models in JAX."""

__version__ = "0.1.0"
