"""Subcommands other than `serve`, each delegating to the module that owns the work."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Adder = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

ADDERS: list[Adder] = []
