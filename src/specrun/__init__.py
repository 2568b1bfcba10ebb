"""specrun: speculative decoding for local GGUF models."""

__version__ = "0.2.0"
