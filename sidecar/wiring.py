"""Plugs the optional components into a Sidecar: each one a gate, a sink or a cleanup context.

Owns: the order in which components see a request. Never: holds state of its own.
"""

from __future__ import annotations

from .app import Sidecar


def wire(sc: Sidecar) -> Sidecar:
    """Attach every component the config turns on. Returns `sc` for chaining."""
    return sc
