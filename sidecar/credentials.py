"""An API key's public face: the key a client presented, and the short id that stands for it.

Owns: reading the key from `Authorization` or `x-api-key` (`bearer`), its digest and its id
(`key_id`, `api_key_id`), shared by identity (which verifies keys) and audit (which redacts them).
Never: logs, stores or returns a key; only its digest leaves this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

# Anthropic's SDKs send the key as `x-api-key` (`api_key`) or as `Authorization: Bearer`
# (`auth_token`); the sidecar takes either, and both are credentials wherever headers are kept.
API_KEY_HEADER = "x-api-key"
KEY_HEADERS = frozenset({"authorization", API_KEY_HEADER})


class ConflictingKeys(ValueError):
    """`Authorization` and `x-api-key` carry different keys: which one is billed is unclear."""


def bearer(headers: Mapping[str, str]) -> str | None:
    """The API key a client presented: `Authorization: Bearer <key>` (or the bare value), or
    `x-api-key: <key>`. Raises ConflictingKeys when both are sent and differ: a server that
    reads the other one must never serve a request billed to this one."""
    key = _authorization(headers.get("Authorization"))
    other = headers.get(API_KEY_HEADER)
    other = other.strip() or None if other else None
    if key is not None and other is not None and key != other:
        raise ConflictingKeys("the Authorization and x-api-key headers carry different keys")
    return key or other


def _authorization(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else value.strip()
    return token or None


def digest(key: str) -> str:
    # aiohttp hands over undecodable header bytes as surrogates: hash them, never fail
    return hashlib.sha256(key.encode("utf-8", "backslashreplace")).hexdigest()


def key_id(key: str | None) -> str | None:
    """A stable, short id for a key: enough to tell keys apart in a report, useless to a thief."""
    return "key-" + digest(key)[:12] if key else None


def api_key_id(authorization: str | None) -> str | None:
    """The key id of an `Authorization` (or `x-api-key`) header value."""
    return key_id(_authorization(authorization)) if authorization else None
