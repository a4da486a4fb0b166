"""The scheduling measurement harness (`tollbooth bench`, `tollbooth make-requests`)."""

from .requests import BenchRequest, Distribution, generate, read, write
from .runner import Arrival, BenchOptions, run

__all__ = [
    "Arrival",
    "BenchOptions",
    "BenchRequest",
    "Distribution",
    "generate",
    "read",
    "run",
    "write",
]
