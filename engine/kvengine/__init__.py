"""kvengine: a small vLLM-style paged-KV inference engine."""

__version__ = "0.1.0"
