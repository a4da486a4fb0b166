"""The two boundaries where a fake stands in: the inference server (vLLM/TGI) and NVML.

FakeUpstream speaks vLLM's and TGI's wire formats (chunk shapes, usage chunks, error events, TGI's
`data:` without a space and its token headers) and can replay the recorded TGI responses in
tests/fixtures/tgi. Behaviour is chosen per request with the `X-Fake` header; every request it sees
is kept in `seen`. FakeNVML reproduces NVML's units and error classes; NoLibrary is NVML on a
machine without a driver, which every test sidecar gets unless it asks for FakeNVML.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from aiohttp import web

TGI_FIXTURES = Path(__file__).parent / "fixtures" / "tgi"  # inside the work tree: see its README
MODEL = "fake/llama-3-8b"
TOKENS_PER_CHUNK = 2  # like vLLM's --stream-interval: a chunk is not a token


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
        self.app = web.Application()
        r = self.app.router
        r.add_post("/v1/chat/completions", self.openai)
        r.add_post("/v1/completions", self.openai)
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

    async def openai(self, request: web.Request) -> web.StreamResponse:
        body, mode = await self._record(request)
        if fixture := request.headers.get("X-Fake-Fixture"):
            return await self._replay(request, fixture)
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
        if not body.get("stream"):
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
        include = (body.get("stream_options") or {}).get("include_usage") is True
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
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if mode == "slow-stream":
                await asyncio.sleep(0.05)
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
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

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
        return web.json_response({"model_id": "fake/tgi-model", "version": "3.3.7"})

    async def models(self, request: web.Request) -> web.Response:
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
        return resp

    async def tgi_compat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        request._read_bytes = raw  # let the routed handler read the body again
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
