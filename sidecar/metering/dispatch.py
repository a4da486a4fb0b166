"""The route an `/invocations` body is dispatched to, told from the body as each server does.

Owns: the order vLLM and TGI try their request models in, and `AmbiguousBody` for a body more
than one of them could serve.
Never: guesses: a body two routes could serve is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..exchange import Endpoint


class AmbiguousBody(ValueError):
    """An /invocations body more than one route could serve; refused with 400."""


def invocation_endpoint(obj: Mapping[str, Any], api: str) -> Endpoint:
    """The route `/invocations` dispatches a body to, in the order the server tries them.

    vLLM validates the body as a chat request (`messages`), then a completion (`prompt`), then a
    pooling request (`input`); TGI tries its generate request (`inputs`), then chat, then
    completion. Text generation is metered; anything else is OTHER.
    """
    order = _TGI_INVOCATIONS if api == "tgi" else _VLLM_INVOCATIONS
    if sum(key in obj for key, _, _ in order) > 1:
        # Which route serves it then depends on which request model fails to validate first
        # (TGI serves {"inputs", "parameters": {"seed": -1}, "messages"} as chat): not guessed.
        names = ", ".join(f"'{key}'" for key, _, _ in order)
        raise AmbiguousBody("an /invocations body names more than one of " + names)
    for key, kinds, endpoint in order:
        if isinstance(obj.get(key), kinds):
            return endpoint
    return Endpoint.OTHER


def generate_api(obj: Mapping[str, Any], api: str) -> str:
    """The server a `/generate` body is for: the configured one when it is TGI or SGLang, else
    told from the body as each reads it. TGI's is `inputs` (+ `parameters`), SGLang's `text` or
    `input_ids` (+ `sampling_params`); a body naming both is refused."""
    if api in ("tgi", "sglang"):
        return api
    tgi = "inputs" in obj or "parameters" in obj
    sglang = any(k in obj for k in _SGLANG_KEYS)
    if tgi and sglang:
        raise AmbiguousBody(
            "a /generate body names both TGI's 'inputs'/'parameters' and SGLang's "
            "'text'/'input_ids'/'sampling_params'"
        )
    return "sglang" if sglang else "tgi"


_SGLANG_KEYS = ("text", "input_ids", "sampling_params", "input_embeds")


_VLLM_INVOCATIONS: tuple[tuple[str, type | tuple[type, ...], Endpoint], ...] = (
    ("messages", list, Endpoint.CHAT),
    ("prompt", (str, list), Endpoint.COMPLETIONS),
    ("input", (str, list), Endpoint.EMBEDDINGS),
)


_TGI_INVOCATIONS: tuple[tuple[str, type | tuple[type, ...], Endpoint], ...] = (
    ("inputs", str, Endpoint.TGI_COMPAT),
    ("messages", list, Endpoint.CHAT),
    ("prompt", (str, list), Endpoint.COMPLETIONS),
)
