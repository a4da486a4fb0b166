"""An API key's public face: the key a client presented, and the short id that stands for it.

Owns: reading the key from `Authorization` (`bearer`), its digest and its id (`key_id`,
`api_key_id`), shared by identity (which verifies keys) and audit (which redacts them).
Never: logs, stores or returns a key; only its digest leaves this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


def bearer(headers: Mapping[str, str]) -> str | None:
    """The API key a client presented: `Authorization: Bearer <key>` (or the bare value)."""
    value = headers.get("Authorization")
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
    """The key id of an `Authorization` header value."""
    return key_id(bearer({"Authorization": authorization})) if authorization else None
