"""A simulated vLLM/TGI server: the test double and the demo's upstream. Never a source of
metrics that claim to be real."""

from .engine import Engine, EngineParams, OutOfMemory, tokenize
from .server import create_simulator

__all__ = ["Engine", "EngineParams", "OutOfMemory", "create_simulator", "tokenize"]
