"""A simulated inference engine: continuous batching over a KV cache of fixed capacity.

Owns: the step loop (each step prefills newly admitted prompts and decodes one token for every
running sequence; its duration grows with the tokens in the batch), KV-cache accounting, and what
happens when the cache is full: preemption (the newest sequence goes back to waiting and is
recomputed later) or an out-of-memory failure (every running sequence fails, as a real server's
log shows memory at 98-99% and then the error, and the queue's context is cleared).
Never: claims to be a measurement of a real GPU. Its numbers are a model, labelled simulated.
Output text depends only on (prompt, seed, position), so batching never changes it, unless
`batch_dependent_output` is on: then each token also depends on how many sequences were decoded in
its step, as a GPU's numerics change with the batch shape (so the harness's comparison can fail).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger("tollbooth.simulator")

_TOKEN = re.compile(r"\w+|[^\w\s]")
VOCAB = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "more",
    "token",
    "cost",
    "budget",
    "queue",
    "batch",
    "model",
    "request",
    "stream",
    "usage",
    "latency",
    "throughput",
    "cache",
    "memory",
]


def tokenize(text: str) -> list[str]:
    """The simulator's tokenizer: words and punctuation. Deterministic and cheap."""
    return _TOKEN.findall(text)


def chat_prompt(messages: list[dict[str, object]]) -> str:
    """A minimal chat template, so chat prompts have a size like a real template's."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|> {content} <|end|>")
    return " ".join(parts) + " <|assistant|>"


class OutOfMemory(Exception):
    """The simulated KV cache overflowed and the engine failed its running sequences."""


@dataclass(frozen=True, kw_only=True)
class EngineParams:
    kv_capacity_tokens: int = 65536  # simulated KV cache, tokens
    # When the KV cache is full: preempt the newest sequences (recomputed later), or fail all.
    on_full: Literal["preempt", "oom"] = "preempt"
    step_base_s: float = 0.004  # fixed cost of one forward step
    prefill_s_per_token: float = 0.00002
    decode_s_per_seq: float = 0.0002  # extra per running sequence in a step
    max_num_seqs: int = 256
    max_model_len: int = 32768
    # Opt-in: a token depends on the batch it was decoded in (see the module docstring).
    batch_dependent_output: bool = False


@dataclass(eq=False)
class Sequence:
    prompt_tokens: int
    max_tokens: int
    seed: int
    prompt_key: bytes
    out: asyncio.Queue[str | BaseException | None] = field(default_factory=asyncio.Queue)
    generated: int = 0
    prefilled: bool = False
    finish_reason: str = "length"
    stop_at: int = 0
    cancelled: bool = False

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated if self.prefilled else 0

    def token(self, i: int, batch: int = 0) -> str:
        key = self.prompt_key + i.to_bytes(4, "little")
        if batch:  # batch-dependent output only; the default text is unchanged
            key += batch.to_bytes(4, "little")
        h = hashlib.blake2b(key, digest_size=4).digest()
        return " " + VOCAB[int.from_bytes(h, "little") % len(VOCAB)]


class Engine:
    def __init__(self, params: EngineParams) -> None:
        self.p = params
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # counters for the simulator's own /metrics (all simulated)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        self.oom_total = 0
        self.requests_total = 0

    @property
    def kv_used(self) -> int:
        return sum(s.kv_tokens for s in self.running)

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.p.kv_capacity_tokens

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def submit(self, prompt: str, max_tokens: int, seed: int) -> Sequence:
        n = len(tokenize(prompt))
        key = hashlib.blake2b(f"{seed}\x00{prompt}".encode(), digest_size=16).digest()
        seq = Sequence(prompt_tokens=n, max_tokens=max_tokens, seed=seed, prompt_key=key)
        # A deterministic early stop for some requests, so outputs vary in length.
        h = int.from_bytes(key[:4], "little")
        seq.stop_at = max_tokens if h % 10 < 7 else max(1, (h >> 8) % max(1, max_tokens))
        self.waiting.append(seq)
        self.requests_total += 1
        self._wake.set()
        return seq

    async def generate(self, seq: Sequence) -> AsyncIterator[str]:
        """Tokens as the engine produces them; raises OutOfMemory if the engine failed."""
        try:
            while True:
                item = await seq.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            seq.cancelled = True  # a client that leaves frees its sequence at the next step

    # --- the step loop

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            prefill = self._schedule()
            await asyncio.sleep(self._step_time(prefill))
            if self._overflowed():
                continue
            self._emit()

    def _schedule(self) -> int:
        """Admit waiting sequences while their prompts fit the cache now (as vLLM does)."""
        self.running = [s for s in self.running if not s.cancelled]
        prefill = 0
        while self.waiting and len(self.running) < self.p.max_num_seqs:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                continue
            need = seq.prompt_tokens + seq.generated + 1
            if self.kv_used + need > self.p.kv_capacity_tokens and self.running:
                break
            self.waiting.popleft()
            seq.prefilled = True
            self.running.append(seq)
            prefill += seq.prompt_tokens + seq.generated
        return prefill

    def _step_time(self, prefill_tokens: int) -> float:
        p = self.p
        return (
            p.step_base_s
            + prefill_tokens * p.prefill_s_per_token
            + len(self.running) * p.decode_s_per_seq
        )

    def _overflowed(self) -> bool:
        """Decoding grows every sequence by one token; past capacity, preempt or fail."""
        need = self.kv_used + len(self.running)
        if need <= self.p.kv_capacity_tokens:
            return False
        if self.p.on_full == "preempt":
            while self.running and self.kv_used + len(self.running) > self.p.kv_capacity_tokens:
                victim = self.running.pop()  # the newest: recomputed from its prompt later
                victim.prefilled = False  # keeps its tokens so far; its cache is rebuilt
                self.waiting.appendleft(victim)
                self.preemptions_total += 1
            return False
        log.warning(
            "simulated KV cache usage %.1f%% (%d of %d tokens)",
            100 * min(need, self.p.kv_capacity_tokens * 0.99) / self.p.kv_capacity_tokens,
            self.kv_used,
            self.p.kv_capacity_tokens,
        )
        log.error("simulated CUDA out of memory: failing %d running requests", len(self.running))
        self.oom_total += 1
        for seq in self.running:
            seq.out.put_nowait(OutOfMemory("CUDA out of memory (simulated): KV cache exhausted"))
        self.running = []
        return True

    def _emit(self) -> None:
        still = []
        batch = len(self.running) if self.p.batch_dependent_output else 0
        for seq in self.running:
            if seq.cancelled:
                continue
            seq.out.put_nowait(seq.token(seq.generated, batch))
            seq.generated += 1
            self.generation_tokens_total += 1
            if seq.generated >= seq.stop_at:
                seq.finish_reason = "length" if seq.generated >= seq.max_tokens else "stop"
                self.prompt_tokens_total += seq.prompt_tokens
                seq.out.put_nowait(None)
            else:
                still.append(seq)
        self.running = still
