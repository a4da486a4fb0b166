"""The simulator's HTTP face: vLLM's OpenAI-compatible API or TGI's, over one Engine.

Owns: request parsing and the exact response shapes of each server (chunks, usage chunk only when
asked, `data:` with and without a space, TGI's token headers, each server's error bodies), and a
/metrics page of the engine's simulated state. Every number here is simulated and says so.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from sidecar.metering.counts import lax_true
from sidecar.telemetry.metrics import (
    TGI_BATCH,
    TGI_QUEUE,
    VLLM_KV_USAGE,
    VLLM_PREEMPTIONS,
    VLLM_RUNNING,
    VLLM_WAITING,
)

from . import anthropic, audio, pooling
from .engine import Engine, EngineParams, OutOfMemory, chat_prompt, tokenize

Api = Literal["vllm", "tgi"]
ENGINE = web.AppKey("engine", Engine)


@dataclass(frozen=True)
class SimSettings:
    api: Api = "vllm"
    model: str = "sim-llama-3-8b"
    # A reasoning model: every answer reports `completion_tokens_details.reasoning_tokens`
    # (half the output, rounded down). A request with `reasoning_effort` asks for it too.
    reasoning: bool = False
    # vLLM's --enable-prompt-tokens-details: usage carries `prompt_tokens_details.cached_tokens`,
    # the prompt's full 16-token blocks already in the prefix cache (a prompt seen before).
    prompt_tokens_details: bool = False


SETTINGS = web.AppKey("settings", SimSettings)
PREFIX_CACHE = web.AppKey("prefix_cache", dict)  # prompt -> None, oldest first (bounded)
PREFIX_CACHE_PROMPTS = 4096
BLOCK_TOKENS = 16


class BadRequest(Exception):
    pass


@dataclass
class Gen:
    prompt: str
    max_tokens: int
    seed: int
    stream: bool
    include_usage: bool
    model: str
    details: bool = False
    continuous_usage: bool = False  # vLLM: running totals on every chunk (with include_usage)
    reasoning: bool = False  # report reasoning tokens in the final usage


# --- parsing --------------------------------------------------------------------------------------


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _int(body: dict[str, Any], key: str, default: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"'{key}' must be a non-negative integer")
    return v


def openai_gen(body: dict[str, Any], chat: bool, model: str, api: Api = "vllm") -> Gen:
    prompt: Any
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list")
        prompt = chat_prompt(msgs)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string (the simulator takes one prompt)")
    if _int(body, "n", 1) != 1:
        raise BadRequest("the simulator supports n=1 only")
    opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    # vLLM's request models read booleans as pydantic does ("true", 1, "yes" ...); TGI's take
    # only JSON booleans.
    flag = lax_true if api == "vllm" else (lambda v: v is True)
    include_usage = flag((opts or {}).get("include_usage"))
    return Gen(
        prompt=prompt,
        max_tokens=_int({"m": max_tokens}, "m", 16),
        seed=_int(body, "seed", 0),
        stream=flag(body.get("stream")),
        include_usage=include_usage,
        model=body.get("model") or model,
        continuous_usage=include_usage
        and api == "vllm"
        and flag((opts or {}).get("continuous_usage_stats")),
        reasoning=body.get("reasoning_effort") is not None,
    )


def tgi_gen(body: dict[str, Any], model: str, stream: bool) -> Gen:
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise BadRequest("'inputs' must be a string")
    params: dict[str, Any] = body["parameters"] if isinstance(body.get("parameters"), dict) else {}
    return Gen(
        prompt=inputs,
        max_tokens=_int(params, "max_new_tokens", 100),
        seed=_int(params, "seed", 0),
        stream=stream,
        include_usage=False,
        model=model,
        details=params.get("details") is True,
    )


def _check_len(engine: Engine, gen: Gen) -> int:
    n = len(tokenize(gen.prompt))
    if n + gen.max_tokens > engine.p.max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {engine.p.max_model_len} tokens. However, "
            f"you requested {n + gen.max_tokens} tokens ({n} in the messages, {gen.max_tokens} "
            "in the completion)."
        )
    return n


# --- vLLM (OpenAI-compatible) ---------------------------------------------------------------------


def vllm_error(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


async def openai_route(request: web.Request) -> web.StreamResponse:
    return await _openai(request, request.path.endswith("/chat/completions"))


async def vllm_invocations(request: web.Request) -> web.StreamResponse:
    """vLLM's /invocations: a chat request when it has messages, else a completion."""
    try:
        body = await _json(request)
    except BadRequest as exc:
        return vllm_error(400, str(exc), "BadRequestError")
    return await _openai(request, isinstance(body.get("messages"), list))


async def _openai(request: web.Request, chat: bool) -> web.StreamResponse:
    engine, s = request.app[ENGINE], request.app[SETTINGS]
    tgi = s.api == "tgi"
    try:
        gen = openai_gen(await _json(request), chat, s.model, s.api)
        n_prompt = _check_len(engine, gen)
        gen.reasoning = gen.reasoning or s.reasoning
        cached = _cached_tokens(request.app, gen.prompt, n_prompt)
    except BadRequest as exc:
        return (
            tgi_error(422, str(exc), "validation")
            if tgi
            else vllm_error(400, str(exc), "BadRequestError")
        )
    prefix = "chatcmpl-" if chat else "cmpl-"
    rid = "" if tgi else prefix + uuid.uuid4().hex
    obj = "chat.completion" if chat else "text_completion"
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)
    tokens = engine.generate(seq)
    created = int(time.time())
    if not gen.stream:
        try:
            text = "".join([t async for t in tokens])
        except OutOfMemory as exc:
            return (
                tgi_error(424, str(exc), "generation")
                if tgi
                else vllm_error(500, str(exc), "InternalServerError")
            )
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": seq.finish_reason}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": gen.model,
                "choices": [choice],
                "usage": _usage(n_prompt, seq.generated, gen.reasoning, cached),
            }
        )
    resp = _sse_response()
    await resp.prepare(request)
    sep = ": "
    chunk_obj = obj + ".chunk" if chat else obj

    def chunk(delta: str | None, finish: str | None) -> bytes:
        return event(_chunk_payload(delta, finish))

    sent = [0]  # tokens in the chunks written so far: what vLLM's running totals count

    def event(payload: dict[str, Any]) -> bytes:
        if gen.continuous_usage:  # running totals, the chunk's last member
            payload["usage"] = _usage(n_prompt, sent[0])
            del payload["usage"]["prompt_tokens_details"]
        return f"data{sep}{json.dumps(payload)}\n\n".encode()

    def _chunk_payload(delta: str | None, finish: str | None) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            c["delta"] = {"content": delta or ""} if delta is not None else {}
        else:
            c["text"] = delta or ""
        payload: dict[str, Any] = {
            "id": rid,
            "object": chunk_obj,
            "created": created,
            "model": gen.model,
            "choices": [c],
        }
        if tgi:
            payload["usage"] = None
        return payload

    try:
        if chat:
            first = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": gen.model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            await resp.write(event(first))
        async for t in tokens:
            sent[0] += 1
            await resp.write(chunk(t, None))
        await resp.write(chunk(None, seq.finish_reason))
        if gen.include_usage:
            final = {
                "id": rid,
                "object": chunk_obj,
                "created": created,
                "model": gen.model,
                "choices": [],
                "usage": _usage(n_prompt, seq.generated, gen.reasoning, cached),
            }
            await resp.write(f"data{sep}{json.dumps(final)}\n\n".encode())
    except OutOfMemory as exc:
        err = (
            {"error": {"message": str(exc), "http_status_code": 424}}
            if tgi
            else {
                "error": {
                    "message": str(exc),
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        )
        await resp.write(f"data{sep}{json.dumps(err)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _cached_tokens(app: web.Application, prompt: str, n_prompt: int) -> int | None:
    """The prompt's tokens served from the simulated prefix cache (None: not reported). vLLM
    caches full blocks, and never the prompt's last token."""
    if not app[SETTINGS].prompt_tokens_details:
        return None
    seen = app[PREFIX_CACHE]
    hit = prompt in seen
    seen.pop(prompt, None)
    seen[prompt] = None
    while len(seen) > PREFIX_CACHE_PROMPTS:
        del seen[next(iter(seen))]
    return max(n_prompt - 1, 0) // BLOCK_TOKENS * BLOCK_TOKENS if hit else 0


def _usage(
    prompt: int, completion: int, reasoning: bool = False, cached: int | None = None
) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }
    if reasoning:  # a part of completion_tokens, as OpenAI's CompletionTokensDetails
        usage["completion_tokens_details"] = {"reasoning_tokens": completion // 2}
    return usage


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )


async def vllm_tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await _json(request)
    except BadRequest as exc:
        return vllm_error(400, str(exc), "BadRequestError")
    text = (
        chat_prompt(body["messages"])
        if isinstance(body.get("messages"), list)
        else str(body.get("prompt", ""))
    )
    toks = tokenize(text)
    return web.json_response(
        {
            "count": len(toks),
            "max_model_len": engine.p.max_model_len,
            "tokens": list(range(len(toks))),
        }
    )


async def vllm_models(request: web.Request) -> web.Response:
    s = request.app[SETTINGS]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": s.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "tollbooth-simulator",
                    "max_model_len": request.app[ENGINE].p.max_model_len,
                }
            ],
        }
    )


# --- TGI ------------------------------------------------------------------------------------------


def tgi_error(status: int, message: str, err_type: str) -> web.Response:
    return web.json_response({"error": message, "error_type": err_type}, status=status)


async def tgi_generate(request: web.Request, *, compat: bool = False) -> web.StreamResponse:
    engine, s = request.app[ENGINE], request.app[SETTINGS]
    try:
        body = await _json(request)
        stream = compat and body.get("stream") is True
        gen = tgi_gen(body, s.model, stream)
        n_prompt = _check_len(engine, gen)
    except BadRequest as exc:
        return tgi_error(422, str(exc), "validation")
    if gen.stream:
        return await _tgi_stream(request, engine, gen, n_prompt)
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)
    try:
        text = "".join([t async for t in engine.generate(seq)])
    except OutOfMemory as exc:
        return tgi_error(424, f"Request failed during generation: {exc}", "generation")
    out: dict[str, Any] = {"generated_text": text}
    if gen.details:
        out["details"] = {
            "finish_reason": seq.finish_reason,
            "generated_tokens": seq.generated,
            "seed": gen.seed,
            "prefill": [],
            "tokens": [],
        }
    headers = {
        "x-prompt-tokens": str(n_prompt),
        "x-generated-tokens": str(seq.generated),
        "x-compute-type": "simulated",
    }
    return web.json_response([out] if compat else out, headers=headers)


async def tgi_stream_route(request: web.Request) -> web.StreamResponse:
    engine, s = request.app[ENGINE], request.app[SETTINGS]
    try:
        gen = tgi_gen(await _json(request), s.model, True)
        n_prompt = _check_len(engine, gen)
    except BadRequest as exc:
        return tgi_error(422, str(exc), "validation")
    return await _tgi_stream(request, engine, gen, n_prompt)


async def tgi_compat(request: web.Request) -> web.StreamResponse:
    return await tgi_generate(request, compat=True)


async def _tgi_stream(
    request: web.Request, engine: Engine, gen: Gen, n_prompt: int
) -> web.StreamResponse:
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)
    resp = _sse_response()
    await resp.prepare(request)
    text: list[str] = []
    try:
        async for t in engine.generate(seq):
            text.append(t)
            last = len(text) >= seq.stop_at  # the engine decided the length at submit
            details = None
            if last and gen.details:
                details = {
                    "finish_reason": seq.finish_reason,
                    "generated_tokens": len(text),
                    "seed": gen.seed,
                    "input_length": n_prompt,
                }
            await resp.write(_tgi_event(len(text), t, "".join(text) if last else None, details))
    except OutOfMemory as exc:
        err = {"error": f"Request failed during generation: {exc}", "error_type": "generation"}
        await resp.write(f"data:{json.dumps(err)}\n\n".encode())
    return resp


def _tgi_event(index: int, text: str, generated: str | None, details: Any) -> bytes:
    ev = {
        "index": index,
        "token": {"id": index, "text": text, "logprob": -0.5, "special": False},
        "generated_text": generated,
        "details": details,
    }
    return f"data:{json.dumps(ev)}\n\n".encode()


async def tgi_tokenize(request: web.Request) -> web.Response:
    try:
        body = await _json(request)
    except BadRequest as exc:
        return tgi_error(422, str(exc), "validation")
    out, pos = [], 0
    text = str(body.get("inputs", ""))
    for i, tok in enumerate(tokenize(text)):
        start = text.find(tok, pos)
        pos = start + len(tok)
        out.append({"id": i, "text": tok, "start": start, "stop": pos})
    return web.json_response(out)


async def tgi_info(request: web.Request) -> web.Response:
    e, s = request.app[ENGINE], request.app[SETTINGS]
    return web.json_response(
        {
            "model_id": s.model,
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_input_tokens": e.p.max_model_len - 1,
            "max_total_tokens": e.p.max_model_len,
            "version": "simulated",
            "router": "tollbooth-simulator",
        }
    )


# --- llama.cpp ------------------------------------------------------------------------------------
# The shapes of tools/server/server-task.cpp (`to_json_non_oaicompat` of the partial and final
# results): running counts on every event, totals on the `stop: true` one, no [DONE]; a slot's
# prompt cache is simulated as one remembered prompt (the common prefix is `timings.cache_n`).

LLAMA_CACHE = web.AppKey("llama_cache", list)


def _llama_prompt(body: dict[str, Any], infill: bool) -> str:
    parts = [body.get("input_prefix", ""), body.get("prompt", ""), body.get("input_suffix", "")]
    parts = parts if infill else [body.get("prompt")]
    if not all(isinstance(p, str) for p in parts):
        raise BadRequest("the simulator takes one string prompt")
    return " ".join(p for p in parts if p)


async def llama_completion(request: web.Request, *, infill: bool = False) -> web.StreamResponse:
    engine, s = request.app[ENGINE], request.app[SETTINGS]
    try:
        body = await _json(request)
        prompt = _llama_prompt(body, infill)
        n_predict = body.get("n_predict", body.get("max_tokens", -1))
        if isinstance(n_predict, bool) or not isinstance(n_predict, int):
            raise BadRequest("'n_predict' must be an integer")
        gen = Gen(
            prompt,
            n_predict if n_predict > 0 else 16,
            0,
            body.get("stream") is True,
            False,
            s.model,
        )
        n_prompt = _check_len(engine, gen)
    except BadRequest as exc:
        return web.json_response(
            {"error": {"code": 400, "message": str(exc), "type": "invalid_request_error"}},
            status=400,
        )
    toks, cache = tokenize(gen.prompt), request.app[LLAMA_CACHE]
    cache_n = next(
        (i for i, (a, b) in enumerate(zip(toks, cache, strict=False)) if a != b),
        min(len(toks), len(cache)),
    )
    cache[:] = toks
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)

    def final(content: str) -> dict[str, Any]:
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": s.model,
            "tokens_predicted": seq.generated,
            "tokens_evaluated": n_prompt,
            "generation_settings": {"n_predict": n_predict},
            "prompt": gen.prompt,
            "has_new_line": False,
            "truncated": False,
            "stop_type": "limit" if seq.finish_reason == "length" else "eos",
            "stopping_word": "",
            "tokens_cached": n_prompt + seq.generated,
            "timings": {
                "cache_n": cache_n,
                "prompt_n": n_prompt - cache_n,
                "predicted_n": seq.generated,
            },
        }

    if not gen.stream:
        try:
            text = "".join([t async for t in engine.generate(seq)])
        except OutOfMemory as exc:
            return web.json_response(
                {"error": {"code": 500, "message": str(exc), "type": "server_error"}}, status=500
            )
        return web.json_response(final(text))
    resp = _sse_response()
    await resp.prepare(request)
    await resp.write(b": keep-alive\n\n")
    try:
        async for t in engine.generate(seq):
            ev = {
                "index": 0,
                "content": t,
                "tokens": [seq.generated],
                "stop": False,
                "id_slot": 0,
                "tokens_predicted": seq.generated,
                "tokens_evaluated": n_prompt,
            }
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
    except OutOfMemory as exc:
        err = {"error": {"code": 500, "message": str(exc), "type": "server_error"}}
        await resp.write(f"error: {json.dumps(err)}\n\n".encode())
        return resp
    await resp.write(f"data: {json.dumps(final(''))}\n\n".encode())
    return resp


async def llama_infill(request: web.Request) -> web.StreamResponse:
    return await llama_completion(request, infill=True)


# --- Ollama ---------------------------------------------------------------------------------------
# The shapes of ollama's api/types.go (ChatResponse, GenerateResponse, Metrics with `omitempty`
# counts, EmbedResponse) and server/routes.go: NDJSON unless `"stream": false`, the counts only on
# the `done: true` object, errors as `{"error": "..."}` (a line, inside a stream).


def _ollama_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _ollama_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())


async def ollama_generate(request: web.Request, *, chat: bool = False) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _json(request)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("model is required")
        given = body.get("messages") if chat else body.get("prompt")
        if chat and isinstance(given, list) and given:
            prompt = chat_prompt(given)
        elif not chat and isinstance(given, str) and given:
            prompt = given
        else:
            raise BadRequest("the simulator takes non-empty 'messages' or a string 'prompt'")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("json: cannot unmarshal into Go struct field .stream of type bool")
        opts: dict[str, Any] = body["options"] if isinstance(body.get("options"), dict) else {}
        limit = opts.get("num_predict", -1)
        if isinstance(limit, bool) or not isinstance(limit, int | float):
            raise BadRequest("invalid int option 'num_predict'")
        gen = Gen(prompt, int(limit) if limit > 0 else 16, 0, stream is not False, False, model)
        n_prompt = _check_len(engine, gen)
    except BadRequest as exc:
        return _ollama_error(400, str(exc))
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)

    def line(text: str, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": _ollama_now()}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["response"] = text
        out["done"] = done
        if done:
            out["done_reason"] = "length" if seq.finish_reason == "length" else "stop"
            out["total_duration"] = 1000
            for key, n in (("prompt_eval_count", n_prompt), ("eval_count", seq.generated)):
                if n:  # Go's omitempty
                    out[key] = n
        return out

    if not gen.stream:
        try:
            text = "".join([t async for t in engine.generate(seq)])
        except OutOfMemory as exc:
            return _ollama_error(500, str(exc))
        return web.json_response(line(text, True))
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    try:
        async for t in engine.generate(seq):
            await resp.write(json.dumps(line(t, False)).encode() + b"\n")
    except OutOfMemory as exc:
        await resp.write(json.dumps({"error": str(exc)}).encode() + b"\n")
        return resp
    await resp.write(json.dumps(line("", True)).encode() + b"\n")
    return resp


async def ollama_chat(request: web.Request) -> web.StreamResponse:
    return await ollama_generate(request, chat=True)


async def ollama_embed(request: web.Request) -> web.Response:
    try:
        body = await _json(request)
        given = body.get("input")
        inputs = [given] if isinstance(given, str) else given
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            raise BadRequest("invalid input type")
    except BadRequest as exc:
        return _ollama_error(400, str(exc))
    n = sum(len(tokenize(i)) for i in inputs)
    out: dict[str, Any] = {"model": body.get("model"), "embeddings": [[0.1, 0.2] for _ in inputs]}
    out["total_duration"] = 1000
    if n:
        out["prompt_eval_count"] = n
    return web.json_response(out)


# --- SGLang ---------------------------------------------------------------------------------------
# The shapes of sglang's srt/entrypoints/http_server.py (`generate_request`) and
# srt/managers/tokenizer_manager.py (`meta_info`): counts so far on every streamed chunk (text
# cumulative), then `data: [DONE]`; its radix cache simulated as one remembered prompt.

SGLANG_CACHE = web.AppKey("sglang_cache", list)


async def sglang_model_info(request: web.Request) -> web.Response:
    """GET /model_info (and /get_model_info) as an SGLang started without
    --preferred-sampling-params answers it: an absent max_new_tokens is 128 here too."""
    s = request.app[SETTINGS]
    return web.json_response(
        {
            "model_path": s.model,
            "tokenizer_path": s.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def sglang_generate(request: web.Request) -> web.StreamResponse:
    engine, s = request.app[ENGINE], request.app[SETTINGS]
    try:
        body = await _json(request)
        prompt = body.get("text")
        if not isinstance(prompt, str):
            raise BadRequest("the simulator takes one string 'text'")
        params = body.get("sampling_params")
        params = params if isinstance(params, dict) else {}
        gen = Gen(
            prompt,
            _int(params, "max_new_tokens", 128),
            0,
            lax_true(body.get("stream")),
            False,
            s.model,
        )
        n_prompt = _check_len(engine, gen)
    except BadRequest as exc:
        return web.json_response({"error": {"message": str(exc)}}, status=400)
    toks, cache = tokenize(gen.prompt), request.app[SGLANG_CACHE]
    cached = next(
        (i for i, (a, b) in enumerate(zip(toks, cache, strict=False)) if a != b),
        min(len(toks), len(cache)),
    )
    cache[:] = toks
    seq = engine.submit(gen.prompt, gen.max_tokens, gen.seed)
    rid = uuid.uuid4().hex

    def chunk(text: str, n: int, last: bool) -> dict[str, Any]:
        finish = None
        if last:
            finish = {"type": "length", "length": n}
            if seq.finish_reason != "length":
                finish = {"type": "stop", "matched": 2}
        return {
            "text": text,
            "output_ids": list(range(n)),
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": n_prompt,
                "completion_tokens": n,
                "cached_tokens": cached,
                "e2e_latency": 0.01,
            },
            "index": 0,
        }

    if not gen.stream:
        try:
            text = "".join([t async for t in engine.generate(seq)])
        except OutOfMemory as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=500)
        return web.json_response(chunk(text, seq.generated, True))
    resp = _sse_response()
    await resp.prepare(request)
    text, n = "", 0
    try:
        async for t in engine.generate(seq):
            text, n = text + t, n + 1
            last = n >= seq.stop_at  # the engine decided the length at submit
            await resp.write(f"data: {json.dumps(chunk(text, n, last))}\n\n".encode())
    except OutOfMemory as exc:
        err = {"error": {"message": str(exc)}}
        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


# --- shared ---------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def metrics(request: web.Request) -> web.Response:
    """The engine's state under the names vLLM or TGI use, each series labelled simulated="true"."""
    e, s = request.app[ENGINE], request.app[SETTINGS]
    sim = 'simulated="true"'
    if s.api == "vllm":
        sim += f',engine="0",model_name="{s.model}"'  # vLLM's own labels
        engine = [
            ("gauge", VLLM_RUNNING, len(e.running)),
            ("gauge", VLLM_WAITING, len(e.waiting)),
            ("gauge", VLLM_KV_USAGE, round(e.kv_usage, 6)),
            ("counter", "vllm:prompt_tokens_total", e.prompt_tokens_total),
            ("counter", "vllm:generation_tokens_total", e.generation_tokens_total),
            ("counter", VLLM_PREEMPTIONS, e.preemptions_total),
        ]
    else:
        engine = [("gauge", TGI_QUEUE, len(e.waiting)), ("gauge", TGI_BATCH, len(e.running))]
    lines = [
        "# Simulated engine state from tollbooth's simulator; not a measurement of any GPU.",
        "# TYPE tollbooth_simulator_info gauge",
        f'tollbooth_simulator_info{{simulated="true",api="{s.api}",model="{s.model}"}} 1',
    ]
    for kind, name, value in engine:
        family = name.removesuffix("_total") if kind == "counter" else name
        lines += [f"# TYPE {family} {kind}", f"{name}{{{sim}}} {value}"]
    lines += [
        "# TYPE tollbooth_simulator_kv_usage_ratio gauge",
        f"tollbooth_simulator_kv_usage_ratio {e.kv_usage:.6f}",
        "# TYPE tollbooth_simulator_oom_total counter",
        f"tollbooth_simulator_oom_total {e.oom_total}",
        "# TYPE tollbooth_simulator_kv_capacity_tokens gauge",
        f"tollbooth_simulator_kv_capacity_tokens {e.p.kv_capacity_tokens}",
    ]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")


def create_simulator(
    api: Api = "vllm",
    params: EngineParams | None = None,
    model: str = "sim-llama-3-8b",
    reasoning: bool = False,
    prompt_tokens_details: bool = False,
) -> web.Application:
    app = web.Application(client_max_size=audio.MAX_UPLOAD_BYTES)  # audio files: vLLM's 25 MB
    app[SETTINGS] = SimSettings(
        api=api, model=model, reasoning=reasoning, prompt_tokens_details=prompt_tokens_details
    )
    app[PREFIX_CACHE] = {}
    engine = app[ENGINE] = Engine(params or EngineParams())

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(engine_ctx)
    r = app.router
    r.add_post("/v1/chat/completions", openai_route)
    r.add_post("/v1/completions", openai_route)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    app[LLAMA_CACHE] = []
    r.add_post("/completion", llama_completion)  # llama.cpp's native routes, on every api
    r.add_post("/infill", llama_infill)
    r.add_post("/api/chat", ollama_chat)  # Ollama's native routes, on every api
    r.add_post("/api/generate", ollama_generate)
    r.add_post("/api/embed", ollama_embed)
    if api == "vllm":
        r.add_post("/invocations", vllm_invocations)
        r.add_post("/tokenize", vllm_tokenize)
        r.add_get("/v1/models", vllm_models)
        anthropic.add_routes(app, engine)  # vllm/entrypoints/anthropic/
        pooling.add_routes(app, model)  # /pooling, /classify, /score, /rerank ...
        audio.add_routes(app, engine)  # /v1/audio/transcriptions, /translations
        app[SGLANG_CACHE] = []
        r.add_post("/generate", sglang_generate)  # SGLang's (vLLM serves no /generate)
        r.add_get("/model_info", sglang_model_info)
        r.add_get("/get_model_info", sglang_model_info)
    else:
        r.add_post("/generate", tgi_generate)
        r.add_post("/generate_stream", tgi_stream_route)
        r.add_post("/", tgi_compat)
        r.add_post("/tokenize", tgi_tokenize)
        r.add_get("/info", tgi_info)
    return app
