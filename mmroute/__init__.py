"""mmroute: a KV-cache-aware, multimodal-exact router for vLLM and SGLang fleets."""

__version__ = "0.1.0"
