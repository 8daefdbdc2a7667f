"""kenspec server: speculative decoding with a KenLM draft and a transformers target, over gRPC."""

__version__ = "0.1.0"
