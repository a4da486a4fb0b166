"""vLLM's pooling and scoring routes: `/pooling`, `/classify`, `/score`, `/v1/score`, `/rerank`,
`/v1/rerank`, `/v2/rerank` (vllm/entrypoints/pooling/: pooling/, classify/, score/ and
scoring/ protocol.py and api_router.py).

Owns: what such a request asks for (model, user, the text its hold counts: a rerank query once
per document), and reading its answer's `usage` (`prompt_tokens`; rerank's `RerankUsage` has no
`completion_tokens`, and none of these routes generates: the output is 0, measured).
Never: changes a request or a response (nothing is injected or stripped), streams (these routes
answer one JSON body), or invents the input count: a body without `usage` (vLLM's IO-processor
plugin answers) is `no_usage`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..exchange import RERANK_ROUTES, SCORE_ROUTES, Endpoint, RequestInfo, Usage
from . import reqsize
from .counts import body_value
from .openai import OpenAIAdapter, body_usage


class PoolingAdapter(OpenAIAdapter):
    """The OpenAI adapter's reading of a request and of `usage`, without streams or edits."""

    def inspect(
        self,
        endpoint: Endpoint,
        body: bytes,
        text: str | None,
        obj: Mapping[str, Any],
        *,
        inject_usage: bool,
        continuous_usage: bool = False,
    ) -> RequestInfo:
        """As an embeddings request (never a stream, never changed), with the text of a rerank
        or score body counted once per pair for the hold."""
        info = super().inspect(endpoint, body, text, obj, inject_usage=False)
        info.stream = False
        info.n = None
        info.choices = 1
        info.output_cap = 0  # nothing is generated: any output counted is no measurement
        if endpoint in RERANK_ROUTES:
            info.text_chars += reqsize.repeated_chars(obj, (reqsize.RERANK_PAIR,))
        elif endpoint in SCORE_ROUTES:
            info.text_chars += reqsize.repeated_chars(obj, reqsize.SCORE_PAIRS)
        return info

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """`usage.prompt_tokens` as the input; the output is 0 when the body does not say."""
        usage = body_usage(endpoint, body_value(body))
        if usage.input_tokens is not None and usage.output_tokens is None:
            # nothing is generated on these routes: zero is what happened, not a guess
            usage = replace(usage, output_tokens=0, unknown_reason=None)
        return usage
