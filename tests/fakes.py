"""The two boundaries where a fake stands in: the inference server (vLLM/TGI) and NVML.

FakeUpstream speaks vLLM's and TGI's wire formats (chunk shapes, usage chunks, running usage on
every chunk when asked for `continuous_usage_stats`, error events, TGI's `data:` without a space
and its token headers) and can replay the recorded TGI responses in tests/fixtures/tgi. It reads
`stream` and `stream_options` as vLLM does (pydantic's lax booleans) and routes `/invocations` and
`/vertex` by the body's shape as vLLM and TGI do. Behaviour is chosen per request with the `X-Fake`
header; every generation request it sees is kept in `seen`, every tokenizer call in `tokenized`,
and every request whose client (the sidecar) went away mid-answer in `cancelled`. FakeNVML
reproduces NVML's units and error classes; NoLibrary is NVML on a machine without a driver, which
every test sidecar gets unless it asks for FakeNVML.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
from aiohttp import web

TGI_FIXTURES = Path(__file__).parent / "fixtures" / "tgi"  # inside the work tree: see its README
MODEL = "fake/llama-3-8b"
TOKENS_PER_CHUNK = 2  # like vLLM's --stream-interval: a chunk is not a token
_LAX_BOOL = pydantic.TypeAdapter(bool | None)  # how vLLM's request models read a boolean


def vllm_bool(value: Any) -> bool:
    """vLLM's reading of a boolean field (a value pydantic refuses would be a 400 there)."""
    try:
        return bool(_LAX_BOOL.validate_python(value))
    except pydantic.ValidationError:
        return False


def _compact(obj: dict[str, Any]) -> bytes:
    """One SSE event in vLLM's serialisation (pydantic's compact JSON)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def load_fixture(name: str) -> Any:
    return json.loads((TGI_FIXTURES / name).read_text())


def prompt_tokens(body: dict[str, Any]) -> int:
    text = body.get("prompt") or body.get("inputs") or body.get("input") or ""
    if isinstance(text, list):
        text = " ".join(map(str, text))
    for m in body.get("messages") or []:
        text += " " + str(m.get("content", ""))
    return len(str(text).split())


class FakeUpstream:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.tokenized: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self.tokenize_fails = False
        self.tokenize_body: bytes | None = None  # /tokenize answers these bytes, 200, when set
        self.sent_tokens = 0  # completion tokens in the last chunk written (running totals)
        # TGI's GET /info, as a TGI started with --max-total-tokens 4096 answers it (a test may
        # change it, or make it None: /info then answers 404; bytes are sent as they are)
        self.info_body: dict[str, Any] | bytes | None = {
            "model_id": "fake/tgi-model",
            "version": "3.3.7",
            "max_input_tokens": 4095,
            "max_total_tokens": 4096,
        }
        self.app = web.Application()
        r = self.app.router
        r.add_post("/v1/chat/completions", self.openai)
        r.add_post("/v1/completions", self.openai)
        r.add_post("/invocations", self.invocations)
        r.add_post("/vertex", self.vertex)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/chat_tokenize", self.tokenize)
        r.add_post("/v1/messages", self.echo)
        r.add_post("/pooling", self.echo)
        r.add_post("/v1/embeddings", self.embeddings)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/generate", self.tgi_generate)
        r.add_post("/generate_stream", self.tgi_stream)
        r.add_post("/", self.tgi_compat)
        r.add_get("/info", self.info)
        r.add_get("/v1/models", self.models)
        r.add_post("/echo", self.echo)

    async def _record(self, request: web.Request) -> tuple[dict[str, Any], str]:
        raw = await request.read()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": raw})
        mode = request.headers.get("X-Fake", "")
        if mode.startswith("sleep"):
            await asyncio.sleep(float(mode.split(":")[1]))
        try:
            body = json.loads(raw)
        except ValueError:
            raise web.HTTPBadRequest(
                text=json.dumps(
                    {
                        "error": {
                            "message": "bad json",
                            "type": "BadRequestError",
                            "param": None,
                            "code": 400,
                        }
                    }
                ),
                content_type="application/json",
            ) from None
        return body, mode

    # --- OpenAI-compatible (vLLM shapes) -------------------------------------------------------

    async def openai(self, request: web.Request, chat: bool | None = None) -> web.StreamResponse:
        try:
            return await self._openai(request, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(request.path)  # the sidecar closed the connection mid-answer
            raise

    async def _openai(self, request: web.Request, chat: bool | None) -> web.StreamResponse:
        body, mode = await self._record(request)
        if fixture := request.headers.get("X-Fake-Fixture"):
            return await self._replay(request, fixture)
        if chat is None:
            chat = request.path.endswith("chat/completions")
        n_out = int(body.get("max_tokens") or 6)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens(body),
            "completion_tokens": n_out,
            "total_tokens": prompt_tokens(body) + n_out,
        }
        if mode == "cached":
            usage["prompt_tokens_details"] = {"cached_tokens": 2}
        model = body.get("model") or MODEL
        if mode == "status-400":
            return web.json_response(
                {
                    "error": {
                        "message": "nope",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status=400,
            )
        if not vllm_bool(body.get("stream")):
            text = " ".join(["tok"] * n_out)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return web.json_response(
                {
                    "id": "cmpl-fake",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 1,
                    "model": model,
                    "choices": [choice],
                    "usage": None if mode == "nousage" else usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        opts = body.get("stream_options") or {}
        include = vllm_bool(opts.get("include_usage"))
        running = include and vllm_bool(opts.get("continuous_usage_stats"))
        chunks = max(1, n_out // TOKENS_PER_CHUNK)
        for i in range(chunks):
            if mode == "error-midstream" and i == 1:
                err = {
                    "error": {
                        "message": "engine dead",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if mode == "reset" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                return resp
            last = i == chunks - 1
            delta = {"content": "tok " * TOKENS_PER_CHUNK}
            c: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            c.update({"delta": delta} if chat else {"text": delta["content"]})
            chunk = {
                "id": "cmpl-fake",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1,
                "model": model,
                "choices": [c],
            }
            if running:  # vLLM: running totals on every chunk, as the last member
                done = (i + 1) * TOKENS_PER_CHUNK
                chunk["usage"] = {
                    "prompt_tokens": usage["prompt_tokens"],
                    "total_tokens": usage["prompt_tokens"] + done,
                    "completion_tokens": done,
                }
            await resp.write(_compact(chunk))
            self.sent_tokens = (i + 1) * TOKENS_PER_CHUNK
            if mode == "slow-stream":
                await asyncio.sleep(0.05)
            elif mode.startswith("slow-stream:"):
                await asyncio.sleep(float(mode.split(":")[1]))
        if mode.startswith("slow-usage:"):  # generation over; the usage chunk comes later
            await asyncio.sleep(float(mode.split(":")[1]))
        if mode == "truncate":
            return resp  # ends without [DONE] and without usage
        if include and mode != "nousage":
            final = {
                "id": "cmpl-fake",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(_compact(final))
        await resp.write(b"data: [DONE]\n\n")
        if mode.startswith("slow-eof:"):  # the stream is complete; the response ends later
            await asyncio.sleep(float(mode.split(":")[1]))
        return resp

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /invocations: a chat request if it has messages, else a completion."""
        body = json.loads(await request.read())  # read() keeps the bytes for the handler
        return await self.openai(request, chat=isinstance(body.get("messages"), list))

    async def vertex(self, request: web.Request) -> web.Response:
        """TGI's /vertex: one generated text per instance, and no token counts anywhere."""
        body, _ = await self._record(request)
        return web.json_response({"predictions": [" x" * 3 for _ in body["instances"]]})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize ({"count"}), TGI's /tokenize (a token list) and /chat_tokenize."""
        body = json.loads(await request.read())
        self.tokenized.append({"path": request.path, "body": body})
        if self.tokenize_fails:
            raise web.HTTPInternalServerError()
        if self.tokenize_body is not None:
            return web.Response(body=self.tokenize_body, content_type="application/json")
        n = prompt_tokens(body)
        if request.path == "/chat_tokenize":
            return web.json_response({"tokenize_response": [{"id": i} for i in range(n)]})
        if "inputs" in body:
            return web.json_response([{"id": i, "text": "t"} for i in range(n)])
        return web.json_response({"count": n, "max_model_len": 4096, "tokens": list(range(n))})

    async def _replay(self, request: web.Request, name: str) -> web.StreamResponse:
        data = load_fixture(name)
        if isinstance(data, dict):
            return web.json_response(data)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for ev in data:
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def embeddings(self, request: web.Request) -> web.Response:
        body, _ = await self._record(request)
        n = prompt_tokens(body)
        return web.json_response(
            {
                "object": "list",
                "model": body.get("model") or MODEL,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            }
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body, _ = await self._record(request)
        usage = {
            "input_tokens": prompt_tokens(body),
            "output_tokens": 4,
            "total_tokens": 0,
            "input_tokens_details": {"cached_tokens": 1},
        }
        final = {
            "id": "resp_fake",
            "object": "response",
            "model": body.get("model") or MODEL,
            "status": "completed",
            "error": None,
            "incomplete_details": None,
            "output": [],
            "usage": usage,
        }
        if not body.get("stream"):
            return web.json_response(final)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [
            (
                "response.created",
                {
                    "type": "response.created",
                    "response": {**final, "status": "in_progress", "usage": None},
                },
            )
        ]
        events += [
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"})
        ] * 2
        events += [("response.completed", {"type": "response.completed", "response": final})]
        for name, obj in events:
            await resp.write(f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode())
        return resp

    # --- TGI native -----------------------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        if self.info_body is None:
            raise web.HTTPNotFound()
        if isinstance(self.info_body, bytes):
            return web.Response(body=self.info_body, content_type="application/json")
        return web.json_response(self.info_body)

    async def models(self, request: web.Request) -> web.Response:
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": b""})
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def echo(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return web.Response(body=body, content_type="application/octet-stream")

    async def tgi_generate(self, request: web.Request) -> web.Response:
        body, mode = await self._record(request)
        data = load_fixture("test_flash_llama_test_flash_llama_simple.json")
        headers = {
            "x-prompt-tokens": str(prompt_tokens(body)),
            "x-generated-tokens": str(data["details"]["generated_tokens"]),
        }
        if mode == "tgi-error":
            return web.json_response(
                {"error": "Input validation error", "error_type": "validation"}, status=422
            )
        payload: Any = [data] if request.path == "/" else data
        return web.json_response(payload, headers=headers)

    async def tgi_stream(self, request: web.Request) -> web.StreamResponse:
        body, mode = await self._record(request)
        details = (body.get("parameters") or {}).get("details") is True
        n = int((body.get("parameters") or {}).get("max_new_tokens") or 5)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            if mode == "tgi-stream-error" and i == 2:
                err = {"error": "Request failed during generation", "error_type": "generation"}
                await resp.write(f"data:{json.dumps(err)}\n\n".encode())
                return resp
            last = i == n - 1
            ev: dict[str, Any] = {
                "index": i + 1,
                "token": {"id": i, "text": " x", "logprob": -0.1, "special": False},
                "generated_text": " x" * n if last else None,
                "details": None,
            }
            if last and details:
                ev["details"] = {
                    "finish_reason": "length",
                    "generated_tokens": n,
                    "seed": None,
                    "input_length": prompt_tokens(body),
                }
            await resp.write(f"data:{json.dumps(ev)}\n\n".encode())
            if mode.startswith("slow-stream:"):
                await asyncio.sleep(float(mode.split(":")[1]))
        return resp

    async def tgi_compat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        request._read_bytes = raw  # let the routed handler read the body again
        if not isinstance(body.get("stream", False), bool):  # serde takes only a JSON boolean
            return web.json_response(
                {"error": "invalid type: expected a boolean", "error_type": "validation"},
                status=422,
            )
        if body.get("stream"):
            return await self.tgi_stream(request)
        return await self.tgi_generate(request)


# --- the NVML boundary ----------------------------------------------------------------------------


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class FakeNVML:
    """Reproduces what the sidecar reads: mW, mJ, bytes, percent, and per-GPU NotSupported."""

    NVML_TEMPERATURE_GPU = 0
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, gpus: int = 2, no_energy_on: int | None = 1) -> None:
        self.gpus, self.no_energy_on = gpus, no_energy_on
        self.energy_mj = [1_000_000] * gpus
        self.inited = False

    def nvmlInit(self) -> None:
        self.inited = True

    def nvmlShutdown(self) -> None:
        self.inited = False

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000-{h}"

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=150_000_000_000, used=120_000_000_000, free=30_000_000_000)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 612_500  # mW

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 61

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        if h == self.no_energy_on:
            raise NVMLError_NotSupported("Not Supported")
        self.energy_mj[h] += 500_000  # +500 J per read
        return self.energy_mj[h]


class NoLibrary:
    """NVML as on a machine without the library: what every test sidecar gets unless it asks for
    FakeNVML, so the suite behaves the same on a machine with a GPU."""

    def nvmlInit(self) -> None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
