"""Tollbooth: a token-cost observability sidecar for self-hosted vLLM and TGI."""

__version__ = "0.1.0"
