"""The simulator's vLLM pooling and scoring routes: `/pooling`, `/classify`, `/score`,
`/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`, in the response shapes of vLLM's
vllm/entrypoints/pooling/ (PoolingResponse, ClassificationResponse, ScoreResponse with UsageInfo;
RerankResponse with RerankUsage: `prompt_tokens` and `total_tokens` only).

Owns: those routes' bodies and their counts: the simulator's tokenizer over each input, and for
score and rerank over every (query, document) pair, whatever `top_n` returns.
Never: schedules on the engine (nothing is generated) or streams.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from aiohttp import web

from .engine import chat_prompt, tokenize

MODEL = web.AppKey("pooling_model", str)

SCORE_PAIRS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def _error(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    return web.json_response(body, status=400)


def _texts(value: object) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _score(a: str, b: str) -> float:
    """A deterministic relevance in [0, 1) for a pair."""
    digest = hashlib.sha256(f"{a}\0{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


def _usage(tokens: int, *, rerank: bool = False) -> dict[str, Any]:
    if rerank:  # RerankUsage
        return {"prompt_tokens": tokens, "total_tokens": tokens}
    return {  # UsageInfo
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


async def _body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _inputs(body: dict[str, Any]) -> list[str] | None:
    if isinstance(body.get("messages"), list):
        return [chat_prompt(body["messages"])]
    return _texts(body.get("input"))


async def pooling(request: web.Request) -> web.Response:
    body = await _body(request)
    texts = _inputs(body) if body is not None else None
    if body is None or texts is None:
        return _error("'input' must be a string or a list of strings, or 'messages' a list")
    counts = [len(tokenize(t)) for t in texts]
    data = [
        {"index": i, "object": "pooling", "data": [round(_score(t, "p"), 6)] * 4}
        for i, t in enumerate(texts)
    ]
    return _list(body, "pool-", data, _usage(sum(counts)), request)


async def classify(request: web.Request) -> web.Response:
    body = await _body(request)
    texts = _inputs(body) if body is not None else None
    if body is None or texts is None:
        return _error("'input' must be a string or a list of strings, or 'messages' a list")
    data = []
    for i, t in enumerate(texts):
        p = _score(t, "c")
        data.append(
            {
                "index": i,
                "label": "LABEL_0" if p < 0.5 else "LABEL_1",
                "probs": [1 - p, p],
                "num_classes": 2,
            }
        )
    usage = _usage(sum(len(tokenize(t)) for t in texts))
    return _list(body, "classify-", data, usage, request)


def _pairs(first: list[str], second: list[str]) -> list[tuple[str, str]] | None:
    if len(first) == 1:
        return [(first[0], s) for s in second]
    return list(zip(first, second, strict=True)) if len(first) == len(second) else None


async def score(request: web.Request) -> web.Response:
    body = await _body(request)
    pairs = None
    for a, b in SCORE_PAIRS:
        if body is not None and a in body and b in body:
            first, second = _texts(body[a]), _texts(body[b])
            pairs = _pairs(first, second) if first and second else None
            break
    if body is None or not pairs:
        return _error("a score request pairs text_1 with text_2 (or queries with documents)")
    data = [
        {"index": i, "object": "score", "score": _score(q, d)} for i, (q, d) in enumerate(pairs)
    ]
    usage = _usage(sum(len(tokenize(q)) + len(tokenize(d)) for q, d in pairs))
    return _list(body, "score-", data, usage, request)


async def rerank(request: web.Request) -> web.Response:
    body = await _body(request)
    query = body.get("query") if body is not None else None
    docs = _texts(body.get("documents")) if body is not None else None
    if body is None or not isinstance(query, str) or docs is None:
        return _error("'query' must be a string and 'documents' a list of strings")
    scored = sorted(
        (
            {"index": i, "document": {"text": d}, "relevance_score": _score(query, d)}
            for i, d in enumerate(docs)
        ),
        key=lambda r: -float(r["relevance_score"]),  # type: ignore[arg-type]
    )
    top_n = body.get("top_n")
    if isinstance(top_n, int) and top_n > 0:
        scored = scored[:top_n]
    tokens = sum(len(tokenize(query)) + len(tokenize(d)) for d in docs)  # every pair, any top_n
    model = body.get("model") or request.app[MODEL]
    return web.json_response(
        {
            "id": "rerank-" + uuid.uuid4().hex,
            "model": model,
            "usage": _usage(tokens, rerank=True),
            "results": scored,
        }
    )


def _list(
    body: dict[str, Any],
    prefix: str,
    data: list[dict[str, Any]],
    usage: dict[str, Any],
    request: web.Request,
) -> web.Response:
    return web.json_response(
        {
            "id": prefix + uuid.uuid4().hex,
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model") or request.app[MODEL],
            "data": data,
            "usage": usage,
        }
    )


def add_routes(app: web.Application, model: str) -> None:
    """vLLM's pooling and scoring routes on `app`."""
    app[MODEL] = model
    r = app.router
    r.add_post("/pooling", pooling)
    r.add_post("/classify", classify)
    for path in ("/score", "/v1/score"):
        r.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r.add_post(path, rerank)
