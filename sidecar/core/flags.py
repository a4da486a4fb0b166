"""Command-line options made from dataclass fields, so that each knob is declared once.

Owns: `option(parser, cls, name)`, an argparse option whose default, type, choices and help come
from field `name` of the dataclass `cls` (its default, its annotation, and the comment written
above or beside it in the class's source), and reading those comments (`field_comments`: the
lines above each field, which `configdoc` writes above each key).
Never: holds a default of its own; the dataclass (sidecar/config.py, or the lab's options) is the
one place a knob's value is written.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any, Literal


def option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    name: str,
    flag: str | None = None,
    **overrides: Any,
) -> argparse.Action:
    """`--name` (or `flag`) for field `name` of dataclass `cls`, its default shown in the help.
    A bool defaulting to False becomes a switch; `overrides` (e.g. `help`) replace what the
    field gives."""
    default, hint = default_of(cls, name), typing.get_type_hints(cls)[name]
    text = field_help(cls, name)
    kw: dict[str, Any] = {"default": default, "help": text and text.replace("%", "%%")}
    if hint is bool and default is False:
        kw["action"] = "store_true"
    else:
        kw.update(typed(hint))
    kw.update(overrides)
    if kw.get("action") != "store_true":
        kw["help"] = f"{kw['help'] or ''} (default: %(default)s)".lstrip()  # argparse fills it
    action = parser.add_argument(flag or "--" + name.replace("_", "-"), **kw)
    action.field = (cls, name)  # type: ignore[attr-defined]  # what tests check it against
    return action


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` (its factory called, for a field that has one)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{cls.__name__}.{name} has no default")


def typed(hint: Any) -> dict[str, Any]:
    """argparse's `type` (and `choices` for a Literal) for an annotation; `X | None` reads X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0] if len(args) == 1 else hint
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return {"choices": list(values), "type": type(values[0])}
    if hint in (int, float, str):
        return {"type": hint}
    return {}


def field_help(cls: type, name: str) -> str | None:
    """The comment above field `name` in the source of `cls`, else the one beside it."""
    above, beside = _comments(cls).get(name, ([], ""))
    return " ".join(above) or beside or None


def field_comments(cls: type) -> dict[str, list[str]]:
    """The comment lines written directly above each field in the class's source."""
    return {name: above for name, (above, _) in _comments(cls).items() if above}


@functools.cache
def _comments(cls: type) -> dict[str, tuple[list[str], str]]:
    """Each field's comment lines above it, and the comment beside it, in the class's source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (e.g. a zipped install): no comments
        return {}
    lines = source.splitlines()
    beside = {
        tok.start[0]: tok.string.removeprefix("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip()[:1] != "#"
    }
    (classdef,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    out: dict[str, tuple[list[str], str]] = {}
    for node in classdef.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            i = node.lineno - 2  # the line above, 0-based
            while i >= 0 and lines[i].lstrip().startswith("#"):
                above.insert(0, lines[i].strip().removeprefix("#").strip())
                i -= 1
            out[node.target.id] = (above, beside.get(node.end_lineno or node.lineno, ""))
    return out
