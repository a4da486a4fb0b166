"""Strings from outside, made safe once: where a client's or an upstream's text becomes a value
the sidecar keeps (a label, a ledger row, a log line, a span attribute, an audit record).

Owns: `clean(value, limit)`: valid Unicode (a lone surrogate becomes U+FFFD), no NUL or other
control character (each becomes U+FFFD), at most `limit` characters. A longer value keeps its
first characters and a digest of the whole, so two long names that share a prefix stay apart.
Never: raises, or returns text that SQLite, PostgreSQL, a log or an exporter could refuse.
"""

from __future__ import annotations

import hashlib
import re

# Limits, in characters, for each kind of string: what a real one needs, with room to spare.
MODEL_CHARS = 256  # Hugging Face ids are at most 96 characters; local paths can be longer
USER_CHARS = 128
ID_CHARS = 128  # request and response ids
REASON_CHARS = 64  # error types, finish reasons

_DIGEST_HEX = 16
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def digest(value: str) -> str:
    """16 hex digits of the SHA-256 of `value` (lone surrogates included, as they were sent)."""
    data = value.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:_DIGEST_HEX]


def clean(value: str, limit: int) -> str:
    """`value` as safe, bounded text: see the module's docstring. `limit` is at least 32."""
    if len(value) > limit:
        value = value[: limit - _DIGEST_HEX - 1] + "~" + digest(value)
    if value.isprintable():  # the usual case: one scan in C, no copy
        return value
    return _UNSAFE.sub("\ufffd", value)


def clean_or_none(value: object, limit: int) -> str | None:
    """A non-empty string made safe, None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) <= limit and value.isprintable():  # `clean`'s usual case, without its call
        return value
    return clean(value, limit)
