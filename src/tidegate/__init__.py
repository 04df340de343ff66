"""tidegate: an OpenAI-compatible gateway and control plane that keeps an LLM API answering when traffic surges."""

__version__ = "0.1.0"
__all__ = ["__version__"]
