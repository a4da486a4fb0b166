"""Which requests are metered, decided on the path the upstream will be sent.

Owns: the metered routes (`Endpoint`), the one normalised path every route decision is made on
and that is forwarded (`routing_path`), the route `/invocations` dispatches a body to, and the
bounded names of the unmetered routes.
Never: decides on a path other than the one forwarded, or guesses what an ambiguous path means.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

from ..exchange import Endpoint

_ROUTES = {e.value: e for e in Endpoint if e is not Endpoint.OTHER}


class AmbiguousPath(ValueError):
    """A request path whose meaning depends on which server reads it; refused with 400."""


# An encoded slash or backslash is a separator to some servers and a character to others
# (uvicorn decodes %2F before routing, axum does not); an encoded NUL is never a route.
_AMBIGUOUS = re.compile(r"%(2f|5c|00)", re.IGNORECASE)
# A path the normalisation leaves as it is: segments of printable ASCII without `%`, none empty,
# `.` or `..` (a segment may hold a dot, not be one), no trailing slash.
_PLAIN_PATH = re.compile(r"(?:/(?!\.\.?(?:/|\Z))[!-$&-.0-~]+)+")


def routing_path(raw_path: str) -> str:
    """The path every route decision is made on, and the one forwarded upstream.

    Percent-decoded (as UTF-8), repeated slashes collapsed, `.` and `..` segments resolved (never
    above the root), no trailing slash. Raises AmbiguousPath for an encoded `/`, `\\` or NUL, a
    control character, or bytes that are not UTF-8.
    """
    if _PLAIN_PATH.fullmatch(raw_path):
        return raw_path  # already what `_normalised` makes of it (the usual path: no work)
    return _normalised(raw_path)


def _normalised(raw_path: str) -> str:
    if _AMBIGUOUS.search(raw_path):
        raise AmbiguousPath("the path contains an encoded '/', '\\' or NUL")
    try:
        path = unquote(raw_path, errors="strict")
    except UnicodeDecodeError:
        raise AmbiguousPath("the path is not UTF-8 once percent-decoded") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise AmbiguousPath("the path contains a control character")
    segments: list[str] = []
    for seg in path.split("/"):
        if seg == "..":
            if segments:
                segments.pop()
        elif seg and seg != ".":
            segments.append(seg)
    return "/" + "/".join(segments)


# Methods whose body a server may generate from: SGLang routes /generate and /encode on PUT as
# on POST (http_server.py `@app.api_route("/generate", methods=["POST", "PUT"])`), and a server
# may route any of them. A request of another method (GET, HEAD, DELETE, OPTIONS) is forwarded.
GENERATING_METHODS = frozenset({"POST", "PUT", "PATCH"})


def classify(method: str, path: str) -> Endpoint | None:
    """The metered route for a request, or None for anything that is only forwarded.

    `path` is a `routing_path`; a trailing slash is ignored for callers that pass a raw one.
    """
    if method not in GENERATING_METHODS:
        return None
    if len(path) > 1:
        path = path.rstrip("/")
    return _ROUTES.get(path)


# Unmetered routes that generate, named in llm_unmetered_requests_total; any other is "other".
_UNMETERED_CLASSES = frozenset({"/inference/v1/generate", "/invocations"})


def endpoint_class(path: str) -> str:
    """A bounded label for an unmetered route: the known ones by name, the rest "other"."""
    return path if path in _UNMETERED_CLASSES else "other"


def anthropic_route(path: str) -> bool:
    """A route of the Anthropic Messages API: the sidecar's errors there take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")
