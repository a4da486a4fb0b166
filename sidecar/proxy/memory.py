"""Request bytes held in memory: one pool across all connections, and a share of it per key.

Owns: the count of request-body memory reserved now (in all, and by bucket: the key or principal
a request was billed to before its body was read), the two limits (`server.max_buffered_request_
bytes`, `server.max_buffered_request_bytes_per_key`), and the estimate of what parsing a body
costs. A request reserves before it reads (by its Content-Length; a chunked body as each piece
arrives) and keeps its reservation while its body is in memory, until the meter has its record.
Never: blocks or waits for room (a request that does not fit is refused at once, so no held-open
body can make others queue behind it), or lets a reservation outlive its request (`release` is
idempotent and every path out of the handler calls it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Memory a body costs while its request is in flight, per byte received: the body read, and the
# copy sent upstream when usage is injected. While the body is read, its pieces and their join.
HELD_PER_BYTE = 2
# Parsing (json.loads) costs, on top and only while it runs: the decoded text and the strings
# made of it, 1 byte a character each for ASCII (2x); with other characters up to 2 bytes a
# character (4x), and 4 (8x) when a character outside the BMP (a 4-byte UTF-8 sequence) makes a
# string UCS-4; and the Python objects of its structure, counted from the bytes that open them.
# Measured against tracemalloc's peak: docs/performance.md ("Request memory").
PARSE_PER_BYTE_ASCII, PARSE_PER_BYTE_BMP, PARSE_PER_BYTE_WIDE = 2, 4, 8
_UTF8_4BYTE_LEADS = b"\xf0\xf1\xf2\xf3\xf4"
_ESCAPED_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB]")  # `\ud83d`: also outside the BMP
# A str object is about 50 bytes before its text (counted at its two quotes); a list's slot 8 and
# a float 24 (counted at the comma after each item).
PER_OBJECT, PER_ARRAY, PER_ITEM, PER_QUOTE = 200, 64, 32, 28
# Below this a body's parse is counted as HELD_PER_BYTE more: counting its structure would cost
# more than the memory it could take.
PARSE_ESTIMATE_BYTES = 64 * 1024


def parse_cost(body: bytes) -> int:
    """Bytes json.loads may allocate reading `body`, an over-estimate (a few passes in C)."""
    n = len(body)
    if n < PARSE_ESTIMATE_BYTES:
        return HELD_PER_BYTE * n
    if _ESCAPED_HIGH_SURROGATE.search(body):
        per_byte = PARSE_PER_BYTE_WIDE
    elif body.isascii():
        per_byte = PARSE_PER_BYTE_ASCII
    elif any(lead in body for lead in _UTF8_4BYTE_LEADS):
        per_byte = PARSE_PER_BYTE_WIDE
    else:
        per_byte = PARSE_PER_BYTE_BMP
    structure = PER_OBJECT * body.count(b"{") + PER_ARRAY * body.count(b"[")
    items = PER_ITEM * body.count(b",") + PER_QUOTE * body.count(b'"')
    return per_byte * n + structure + items + 4096  # and the few objects around them


TOTAL, PER_KEY = "memory_total", "memory_key"  # why a request did not fit (the refusal's reason)


class NoRoom(Exception):
    """A request's body does not fit in the memory left for request bodies (`reason`), or would
    never fit (`never`: larger than the limit itself)."""

    def __init__(self, reason: str, never: bool) -> None:
        super().__init__(reason)
        self.reason, self.never = reason, never


class TooLarge(Exception):
    """The body is larger than its route's limit (server.max_request_body_bytes, or
    server.max_audio_body_bytes for a streamed one)."""


@dataclass(slots=True)
class Reservation:
    """One request's share of the pool; grows as its body arrives, released once."""

    pool: RequestMemory
    bucket: str | None
    held: int = 0
    handed_over: bool = False  # the exchange owns it now: released when the meter has its record

    def take(self, n: int) -> None:
        """Reserve `n` more bytes, or raise NoRoom (nothing reserved)."""
        pool, bucket = self.pool, self.bucket
        if pool.limit and pool.total + n > pool.limit:
            raise NoRoom(TOTAL, never=self.held + n > pool.limit)
        if bucket is not None and pool.per_key:
            mine = pool.by_bucket.get(bucket, 0)
            if mine + n > pool.per_key:
                raise NoRoom(PER_KEY, never=self.held + n > pool.per_key)
            pool.by_bucket[bucket] = mine + n
        pool.total += n
        if pool.total > pool.peak:
            pool.peak = pool.total
        self.held += n

    def give_back(self, n: int) -> None:
        """Return `n` of the bytes reserved (a parse that is over)."""
        n = min(n, self.held)
        self.held -= n
        pool, bucket = self.pool, self.bucket
        pool.total -= n
        if bucket is not None and pool.per_key:
            left = pool.by_bucket.get(bucket, 0) - n
            if left > 0:
                pool.by_bucket[bucket] = left
            else:  # bounded: only buckets holding bytes now are kept
                pool.by_bucket.pop(bucket, None)

    def release(self) -> None:
        self.give_back(self.held)


@dataclass
class RequestMemory:
    """The pool. `limit` and `per_key` in bytes; 0 turns that limit off."""

    limit: int
    per_key: int
    total: int = 0
    by_bucket: dict[str, int] = field(default_factory=dict)  # buckets with bytes reserved now
    peak: int = 0  # the most reserved at once since start (tests and the benchmark read it)
