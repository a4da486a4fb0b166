"""GET /v1/tollbooth/spend: a client reads its own limits and spend.

Owns: the route's path, who may read it (a request that presents an API key, resolved by the same
`Identity` as every proxied route; an unknown key under a keys file gets 401 even where such keys
are billed to "anonymous"), and the answer `{user, team, project, tags, limits: [...]}`
(docs/budgets.md, "What a client sees").
Never: forwards the request upstream, meters it, or shows a limit that does not apply to the key
that asks (no other user's, team's, project's or tag's).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from ..credentials import ConflictingKeys, bearer
from ..telemetry.metrics import sanitize
from .headers import error_response
from .identity import Identity, Unauthorized

SPEND_PATH = "/v1/tollbooth/spend"

# (user, team, project, tags) -> the limits that apply with their spend; None: store unreadable
Statement = Callable[
    [str, str | None, str | None, Sequence[str]], Awaitable[list[dict[str, object]] | None]
]


async def answer(
    request: web.Request, identity: Identity, statement: Statement | None
) -> web.Response:
    if request.method != "GET":
        return error_response(405, "method_not_allowed", f"{SPEND_PATH} takes GET")
    try:
        key = bearer(request.headers)
        principal = identity.resolve(request.headers, None)
    except (Unauthorized, ConflictingKeys) as exc:
        return error_response(401, "invalid_api_key", str(exc))
    if not key:
        return error_response(401, "invalid_api_key", "missing API key")
    if identity.keys is not None and identity.keys.lookup(key) is None:
        return error_response(401, "invalid_api_key", "invalid API key")
    user = sanitize(principal.user, 128)  # as request.new_exchange names the billed user
    limits: list[dict[str, object]] | None = []
    if statement is not None:
        limits = await statement(user, principal.team, principal.project, principal.tags)
    if limits is None:
        return error_response(
            503, "budget_store_unavailable", "the shared budget store cannot be read now", 1
        )
    body = {
        "user": user,
        "team": principal.team,
        "project": principal.project,
        "tags": list(principal.tags),
        "limits": limits,
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})
