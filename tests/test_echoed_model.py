"""Servers of one model that answer a request's `model` with the request's own string, whatever
it names (h-rev6 finding 9): SGLang's OpenAI and Anthropic routes (`serving_chat.py` builds every
answer with `model=request.model`, no check against the model it serves) and TGI's chat route
(`server.rs` `chat_completions`: the request's `model` unless it is "tgi" or absent; the name is
also its LoRA `adapter_id`, an unknown one the base model, `flash_causal_lm.py`). A client naming
the price book's cheapest model was priced, held and recorded at it for the dearest one. Now such
a request is the model the server serves (`upstream.model_name`, TGI's /info `model_id`); vLLM,
which refuses a model it does not serve (404), is read as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import Config, ConfigError, build, validate
from tests.test_native_model import CHEAP, SERVED, TWO_PRICES


def test_sglang_with_named_prices_needs_its_model_name() -> None:
    """SGLang answers with whatever name a request sends: with prices by name and no
    upstream.model_name, no request could be priced at the model it was served by."""
    data: dict[str, Any] = {"upstream": {"api": "sglang"}, "pricing": TWO_PRICES}
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        validate(build(Config, data))
    validate(build(Config, {"upstream": {"api": "sglang"}}))  # no prices: nothing to pick
    data["upstream"]["model_name"] = SERVED
    validate(build(Config, data))


def test_a_pricing_file_by_model_for_sglang_needs_its_model_name(tmp_path: Path) -> None:
    """The same for a --pricing file: at start, and on SIGHUP (the old prices stay)."""
    from sidecar.core.app import Sidecar

    by_model, default = tmp_path / "by_model.yaml", tmp_path / "default.yaml"
    by_model.write_text(json.dumps(TWO_PRICES))
    default.write_text(json.dumps({"default": TWO_PRICES["models"][CHEAP]}))
    cfg = validate(build(Config, {"upstream": {"api": "sglang"}}))
    with pytest.raises(ConfigError, match=r"upstream\.model_name"):
        Sidecar(cfg, pricing_path=str(by_model))
    sc = Sidecar(cfg, pricing_path=str(default))
    default.write_text(by_model.read_text())
    sc.reload()
    assert (sc.prices.config.models, sc.prices.price(SERVED)) == ({}, sc.prices.price(CHEAP))
