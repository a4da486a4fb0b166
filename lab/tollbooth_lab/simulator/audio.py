"""The simulator's vLLM speech-to-text routes: `/v1/audio/transcriptions`, `/v1/audio/translations`,
in the shapes of vLLM's vllm/entrypoints/openai/speech_to_text/ (protocol.py, speech_to_text.py,
api_router.py).

Owns: reading the multipart form (its fields, the file's bytes), the audio's duration (a WAV's
frames over its rate; any other file as 16 kHz 16-bit mono PCM, 32,000 bytes a second), and the
answers as vLLM writes them: json and text alike as JSON, a transcription's with
`usage: {"type": "duration", "seconds": ceil(duration)}`, a translation's without usage;
verbose_json with `duration` as a string and segments; srt and vtt refused (400); a stream of
`transcription.chunk` / `translation.chunk` events, the token `usage` chunk only when the form
asked `stream_include_usage`, then `[DONE]`.
Never: decodes audio (the text is made up, its length from the duration), or paces anything
but through the engine, as the other routes do.
"""

from __future__ import annotations

import io
import json
import math
import time
import uuid
import wave
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import BodyPartReader, web

from .engine import Engine

ENGINE = web.AppKey("audio_engine", Engine)
PCM_BYTES_PER_SECOND = 32_000
DECODER_PROMPT_TOKENS = 4  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>
FORMATS = ("json", "text", "verbose_json")
MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # VLLM_MAX_AUDIO_CLIP_FILESIZE_MB's default
MAX_TOKENS = 448  # whisper's max_target_positions


def duration(data: bytes) -> float:
    """Seconds of audio in `data`."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            return float(w.getnframes()) / float(w.getframerate())
    except (wave.Error, EOFError, ZeroDivisionError):
        return len(data) / PCM_BYTES_PER_SECOND


def _error(message: str, status: int = 400) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.json_response(body, status=status)


async def _form(request: web.Request) -> tuple[dict[str, str], bytes | None]:
    fields: dict[str, str] = {}
    data: bytes | None = None
    reader = await request.multipart()
    async for part in reader:
        if not isinstance(part, BodyPartReader) or part.name is None:
            continue
        if part.filename is not None:
            data = await part.read()
        else:
            fields[part.name] = await part.text()
    return fields, data


def _true(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "on", "yes", "y", "t")


async def _route(request: web.Request, task: str) -> web.StreamResponse:
    try:
        fields, data = await _form(request)
    except (ValueError, AssertionError):
        return _error("the body is not multipart/form-data", 422)
    if data is None:
        return _error("Field required: file", 422)
    fmt = fields.get("response_format", "json")
    if fmt not in FORMATS:
        return _error("Currently only support response_format: `text`, `json` or `verbose_json`")
    stream = _true(fields.get("stream"))
    if fmt == "verbose_json" and stream:
        return _error("verbose_json format doesn't support streaming case")
    if not stream and (_true(fields.get("stream_include_usage"))):
        return _error("Stream options can only be defined when `stream=True`.")
    seconds = duration(data)
    model = fields.get("model") or "whisper-sim"
    limit = fields.get("max_completion_tokens")
    # Two words a second of speech; max_completion_tokens sets it (vLLM: whisper's output length
    # is not bounded by its audio), at most MAX_TOKENS.
    words = int(limit) if limit and limit.isdigit() else math.ceil(seconds * 2)
    max_tokens = min(max(1, words), MAX_TOKENS)
    seq = request.app[ENGINE].submit(f"audio {len(data)}", max_tokens, len(data))
    tokens = request.app[ENGINE].generate(seq)
    if stream:
        include = _true(fields.get("stream_include_usage"))
        running = include and _true(fields.get("stream_continuous_usage_stats"))
        return await _stream(request, task, model, tokens, include, running)
    text = "".join([t async for t in tokens])
    if fmt == "verbose_json":
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": seconds, "text": text, "tokens": []}
        segment |= {"temperature": 0.0, "avg_logprob": -0.1, "compression_ratio": 1.0}
        body: dict[str, Any] = {"duration": str(seconds), "language": "en", "text": text}
        return web.json_response({**body, "segments": [segment], "words": None})
    if task == "transcribe":  # "no usage in response for translation task"
        usage = {"type": "duration", "seconds": math.ceil(seconds)}
        return web.json_response({"text": text, "usage": usage})
    return web.json_response({"text": text})


async def _stream(
    request: web.Request,
    task: str,
    model: str,
    tokens: AsyncIterator[str],
    include: bool,
    running: bool,
) -> web.StreamResponse:
    kind = "transcription.chunk" if task == "transcribe" else "translation.chunk"
    rid = f"{task}-{uuid.uuid4().hex}"
    created = int(time.time())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    base = {"id": rid, "object": kind, "created": created, "model": model}
    out = 0

    def usage() -> dict[str, int]:
        prompt = DECODER_PROMPT_TOKENS
        return {"prompt_tokens": prompt, "total_tokens": prompt + out, "completion_tokens": out}

    async for token in tokens:
        out += 1
        chunk = {**base, "choices": [{"delta": {"content": token}}]}
        await resp.write(event({**chunk, "usage": usage()} if running else chunk))
    last = {"delta": {"content": ""}, "finish_reason": "stop", "stop_reason": None}
    chunk = {**base, "choices": [last]}
    await resp.write(event({**chunk, "usage": usage()} if running else chunk))
    if include:
        await resp.write(event({**base, "choices": [], "usage": usage()}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "transcribe")


async def translations(request: web.Request) -> web.StreamResponse:
    return await _route(request, "translate")


def add_routes(app: web.Application, engine: Engine) -> None:
    app[ENGINE] = engine
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", translations)
