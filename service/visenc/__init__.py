"""visenc: async vision-encoder service for multimodal LLM serving."""

__version__ = "0.1.0"
