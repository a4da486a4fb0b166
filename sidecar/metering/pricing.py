"""Prices and cost: USD per million tokens (and per second of audio), per model.

Owns: the price table (from the config or a separate file, re-read on SIGHUP) and the arithmetic
from measured token counts to dollars.
Never: prices a model it has no price for (that cost is unknown, not $0), or prices a token count
that was not measured.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError, ModelPrice, PricingConfig, build, load_yaml
from ..exchange import Cost, Usage


class PriceBook:
    """The current prices. `replace()` swaps them atomically (SIGHUP reload)."""

    def __init__(self, pricing: PricingConfig) -> None:
        self.replace(pricing)

    @property
    def config(self) -> PricingConfig:
        return self._p

    def replace(self, pricing: PricingConfig) -> None:
        self._p, self._dearest = pricing, dearest(pricing)  # together: on the event loop

    def listed(self, model: str | None) -> ModelPrice | None:
        """The model's own price, where the book lists it (`PricingConfig.listed`: a name and
        its Ollama `:latest` are one model)."""
        return None if model is None else self._p.listed(model)

    def price(self, model: str | None) -> ModelPrice | None:
        """The model's price, else the default."""
        own = self.listed(model)
        return own if own is not None else self._p.default

    def hold_price(self, model: str | None) -> ModelPrice | None:
        """The price a budget hold reserves at: the model's own where the book lists it, else
        the dearest of each price in the book (its models' and the default): an engine may serve
        a name the book lacks as a listed model and name that one in its answer, which is then
        charged at that model's price (docs/budgets.md, "The hold"). None for an empty book."""
        own = self.listed(model)
        return own if own is not None else self._dearest

    def cost(self, model: str | None, usage: Usage) -> tuple[Cost | None, str | None]:
        """(cost, None) when both directions are measured and priced, else (None, reason).
        Audio seconds, where the server reported them, are the input: priced per second at the
        model's audio price (none: "no_audio_price"), with any output tokens reported too."""
        price = self.price(model)
        if price is None:
            return None, "no_price"
        if usage.audio_seconds is not None:
            if price.audio_per_second is None:
                return None, "no_audio_price"
            audio = usage.audio_seconds * price.audio_per_second
            out = max(usage.output_tokens or 0, 0) * price.output_per_1m / 1e6
            return Cost(input_usd=audio, output_usd=out), None
        if usage.input_tokens is None or usage.output_tokens is None:
            return None, "usage_unknown"
        return compute(
            price,
            usage.input_tokens,
            usage.cached_input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
        ), None

    def input_cost(self, model: str | None, usage: Usage) -> float | None:
        """Cost of the input alone (audit threshold), when measured and priced."""
        price = self.price(model)
        if usage.audio_seconds is not None:
            cost, _ = self.cost(model, usage)
            return cost.input_usd if cost is not None else None
        if price is None or usage.input_tokens is None:
            return None
        return compute(price, usage.input_tokens, usage.cached_input_tokens, 0).input_usd


def dearest(pricing: PricingConfig) -> ModelPrice | None:
    """The dearest of each price in the book (its models' and the default); None when empty."""
    every = [*pricing.models.values(), *([pricing.default] if pricing.default else [])]
    if not every:
        return None

    def most(field: str) -> float | None:
        known = [v for p in every if (v := getattr(p, field)) is not None]
        return max(known) if known else None

    return ModelPrice(
        input_per_1m=max(p.input_per_1m for p in every),
        output_per_1m=max(p.output_per_1m for p in every),
        cached_input_per_1m=most("cached_input_per_1m"),
        reasoning_per_1m=most("reasoning_per_1m"),
        audio_per_second=most("audio_per_second"),
    )


def compute(
    price: ModelPrice,
    input_tokens: int,
    cached: int | None,
    output_tokens: int,
    reasoning: int | None = None,
) -> Cost:
    """Cached input is part of input, billed at its own price (the input price if none is set);
    reasoning tokens are part of output, likewise (the output price if none is set).
    More cached tokens than input (a buggy upstream) is all of the input, never a negative rest,
    and no count is below zero: a cost is never negative (a negative charge credits a budget)."""
    input_tokens, output_tokens = max(input_tokens, 0), max(output_tokens, 0)
    cached = min(max(cached or 0, 0), input_tokens)
    cached_price = price.cached_input_per_1m
    if cached_price is None:
        cached_price = price.input_per_1m
    inp = ((input_tokens - cached) * price.input_per_1m + cached * cached_price) / 1e6
    out = output_tokens * price.output_per_1m
    if price.reasoning_per_1m is not None and reasoning:
        reasoning = min(max(reasoning, 0), output_tokens)
        out = (output_tokens - reasoning) * price.output_per_1m + reasoning * price.reasoning_per_1m
    return Cost(input_usd=inp, output_usd=out / 1e6)


def load_pricing_file(path: str | Path) -> PricingConfig:
    """A pricing file has the same shape as the config's `pricing:` section."""
    try:
        return build(PricingConfig, load_yaml(path), prefix="pricing")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {path})") from exc
