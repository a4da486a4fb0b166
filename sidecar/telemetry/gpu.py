"""GPU telemetry from NVML, and the join: device time and energy attributed to requests.

Owns: a poller thread that reads NVML every `gpu.poll_interval_s` (never on the event loop), unit
conversion (NVML reports mW and mJ), fields a GPU does not support (absent for that GPU), turning
itself off with one log line when there is no library, driver or GPU, and splitting the served
GPUs' time and energy among the requests in flight.
Never: exports a GPU value it did not read. With telemetry off, no GPU or attribution series exist.

Attribution rule (documented in docs/metrics.md): between two changes of the set of admitted
requests in flight, the served GPUs' time (GPUs x seconds) is divided among them in proportion to
their *estimated* peak tokens (the admission estimate: prompt chars / `chars_per_token` + `n` x
max tokens, `default_max_tokens` when unset, none where nothing is generated). A request takes
part from its admission (time in the admission queue uses no GPU) to its end. The estimate only
sets the split; the totals are measured time and measured energy, and they add up: the requests'
device-seconds sum to the GPU-seconds elapsed while any admitted request was in flight, and the
same holds for energy at each poll. Time with nothing in flight is attributed to no one. A
request's energy is final at the first poll after it ends (`Exchange.energy_j` is set then); it
stays None if a poll in its lifetime could not read the energy.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from ..config import AdmissionConfig, GpuConfig, PricingConfig
from ..exchange import CleanupContext, Exchange, estimate_tokens, held_output
from .metrics import Metrics

log = logging.getLogger("tollbooth.gpu")


class Prices(Protocol):
    """What attribution reads of the price book (metering's `PriceBook`): the prices now, re-read
    on SIGHUP, for `gpu_hour_usd`. A protocol, so telemetry does not import metering."""

    @property
    def config(self) -> PricingConfig: ...


@dataclass
class Device:
    index: int
    uuid: str
    name: str
    handle: Any
    unsupported: set[str]
    last_energy_mj: int | None = None


def load_nvml() -> Any:
    import pynvml  # nvidia-ml-py, NVIDIA's own binding

    return pynvml


class GpuCollector:
    """Polls NVML in a thread. `nvml` is the module boundary: tests pass a fake."""

    def __init__(self, config: GpuConfig, metrics: Metrics, nvml: Any = None) -> None:
        self.config = config
        self.metrics = metrics
        self.nvml = nvml
        self.devices: list[Device] = []
        self.on_poll: Callable[[float | None], None] | None = None  # attribution: joules per poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.up = False

    def start(self) -> bool:
        """Initialise NVML and start polling; False (telemetry off) when that is impossible."""
        c = self.config
        try:
            nvml = self.nvml if self.nvml is not None else load_nvml()
            nvml.nvmlInit()
            self.nvml = nvml
            self.devices = self._select(nvml)
            why = f"no GPU matches gpu.devices={c.devices} (gpu.devices_file: {c.devices_file})"
        except Exception as exc:  # no library, no driver, no GPU: off, with one line
            why, self.devices = _describe(exc), []
        if not self.devices:
            log.warning("GPU telemetry off: %s", why)
            self.metrics.gpu_up.set(0)
            return False
        self.up = True
        self.metrics.gpu_up.set(1)
        self.poll()
        self._thread = threading.Thread(target=self._run, name="tollbooth-nvml", daemon=True)
        self._thread.start()
        log.info(
            "GPU telemetry on for %d GPU(s): %s",
            len(self.devices),
            ", ".join(d.name for d in self.devices),
        )
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.poll()  # a last reading: the energy of requests that ended is complete
        if self.up:
            try:
                self.nvml.nvmlShutdown()
            except Exception as exc:
                log.warning("nvmlShutdown failed: %s", _describe(exc))

    def _select(self, nvml: Any) -> list[Device]:
        wanted = set(self.config.devices)
        if self.config.devices_file:
            wanted |= engine_devices(self.config.devices_file, self.config.devices_file_wait_s)
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name = _text(nvml.nvmlDeviceGetUUID(h)), _text(nvml.nvmlDeviceGetName(h))
            if not wanted or str(i) in wanted or uuid in wanted:
                out.append(Device(i, uuid, name, h, set()))
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            self.poll()

    def poll(self) -> None:
        energy_j: float | None = 0.0
        for d in self.devices:
            e = self._read(d)
            energy_j = None if e is None or energy_j is None else energy_j + e
        if self.on_poll is not None:
            self.on_poll(energy_j)

    def _read(self, d: Device) -> float | None:
        """Export one GPU's readings; return its energy (J) since the last poll, if known."""
        nvml, m, labels = self.nvml, self.metrics, (str(d.index), d.uuid, d.name)
        util = self._field(d, "util", lambda: nvml.nvmlDeviceGetUtilizationRates(d.handle))
        if util is not None:
            m.gpu_util.labels(*labels).set(util.gpu / 100.0)
        mem = self._field(d, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(d.handle))
        if mem is not None:
            m.gpu_mem_used.labels(*labels).set(mem.used)
            m.gpu_mem_total.labels(*labels).set(mem.total)
        power_mw = self._field(d, "power", lambda: nvml.nvmlDeviceGetPowerUsage(d.handle))
        if power_mw is not None:
            m.gpu_power.labels(*labels).set(power_mw / 1000.0)
        temp = self._field(
            d,
            "temperature",
            lambda: nvml.nvmlDeviceGetTemperature(d.handle, nvml.NVML_TEMPERATURE_GPU),
        )
        if temp is not None:
            m.gpu_temp.labels(*labels).set(temp)
        energy_mj = self._field(
            d, "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(d.handle)
        )
        if energy_mj is None:
            return None
        delta = None if d.last_energy_mj is None else max(0, energy_mj - d.last_energy_mj) / 1000
        d.last_energy_mj = energy_mj
        if delta is not None:
            m.gpu_energy.labels(*labels).inc(delta)
        return delta

    def _field(self, d: Device, name: str, read: Callable[[], Any]) -> Any:
        if name in d.unsupported:
            return None
        try:
            return read()
        except Exception as exc:
            if type(exc).__name__ == "NVMLError_NotSupported":
                d.unsupported.add(name)  # absent for this GPU from now on
                log.info("GPU %d (%s) does not support %s", d.index, d.name, name)
            else:
                log.warning("NVML read of %s on GPU %d failed: %s", name, d.index, _describe(exc))
            return None


def engine_devices(path: str, wait_s: float, poll_s: float = 0.1) -> set[str]:
    """The engine's GPUs from `path` (its NVIDIA_VISIBLE_DEVICES as its container saw it), read
    once it exists, within `wait_s`. Raises when it never names one: attributing every visible
    GPU in its place is what this file exists to prevent."""
    end = time.monotonic() + wait_s
    while True:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")[:65536]
        except FileNotFoundError:
            text = ""
        names = {n for n in text.replace(",", " ").split() if n}
        if names and not names & {"all", "none", "void"}:
            return names
        if names or time.monotonic() >= end:
            raise RuntimeError(f"gpu.devices_file {path} names no GPU of the engine: {text[:80]!r}")
        time.sleep(poll_s)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- attribution ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Share:
    exchange: Exchange
    model: str
    user: str
    weight: float
    device_s: float = 0.0
    energy_j: float = 0.0
    energy_known: bool = True  # False once a poll in its lifetime could not read energy
    pending: int = 0  # segments it took part in whose energy is not read yet
    ended: bool = False


class Attribution:
    """Splits GPU-seconds and energy among requests in flight. Runs on the event loop, except
    `poll_energy`, which the poller thread calls; a lock keeps the two apart."""

    def __init__(
        self,
        metrics: Metrics,
        prices: Prices,
        estimate: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.n_gpus = 0  # until telemetry is up (`enable`): till then begin/end do nothing
        self.metrics = metrics
        self.prices = prices
        self.estimate = estimate or AdmissionConfig()  # chars_per_token, default_max_tokens
        self.clock = clock
        self.active: dict[int, Share] = {}
        self._since = clock()  # start of the current segment
        self._last_poll = self._since
        self._segments: list[tuple[float, list[tuple[Share, float]]]] = []
        self._lock = threading.Lock()

    def weight(self, ex: Exchange) -> float:
        info = ex.info
        chars = info.prompt_chars if info.parsed else len(info.body)
        return max(1, estimate_tokens(self.estimate, chars, held_output(info), info.n))

    def enable(self, n_gpus: int) -> None:
        with self._lock:
            self.n_gpus = n_gpus
            self._since = self._last_poll = self.clock()

    def begin(self, ex: Exchange) -> None:
        if not self.n_gpus:
            return
        with self._lock:
            self._close_segment()
            self.active[id(ex)] = Share(ex, ex.model, ex.user, self.weight(ex))

    async def admitted(self, ex: Exchange) -> None:
        """The last gate: a request takes GPU time from its admission, not from its arrival."""
        self.begin(ex)

    def end(self, ex: Exchange) -> None:
        """A sink: the request's device-seconds are final now; energy follows at the next poll."""
        if not self.n_gpus:
            return
        with self._lock:
            self._close_segment()
            share = self.active.pop(id(ex), None)
            if share is None:
                return
            share.ended = True
            if not share.pending:  # every segment it took part in is polled already
                self._settle(share)
        share.model = ex.model  # the served model is known now
        ex.device_seconds = share.device_s
        m = self.metrics
        m.device_seconds.labels(share.model, share.user).inc(share.device_s)
        gpu_hour = self.prices.config.gpu_hour_usd
        if gpu_hour is not None:
            ex.device_cost_usd = share.device_s / 3600 * gpu_hour
            m.device_cost.labels(share.model, share.user).inc(ex.device_cost_usd)

    def poll_energy(self, energy_j: float | None) -> None:
        """Called after each NVML poll with the energy read since the previous one."""
        with self._lock:
            self._close_segment()
            now, segments = self.clock(), self._segments
            span, self._segments, self._last_poll = now - self._last_poll, [], now
        polled = collections.Counter(share for _, parts in segments for share, _ in parts)
        for duration, parts in segments:  # outside the lock: the event loop never waits on it
            for share, fraction in parts:
                if energy_j is None or span <= 0:
                    share.energy_known = False
                    continue
                joules = energy_j * duration / span * fraction
                share.energy_j += joules
                self.metrics.energy.labels(share.model).inc(joules)
        with self._lock:
            for share, n in polled.items():
                share.pending -= n
                if share.ended and not share.pending:
                    self._settle(share)

    @staticmethod
    def _settle(share: Share) -> None:
        """No segment can add to its energy any more: put it on the exchange, if measured."""
        if share.energy_known:
            share.exchange.energy_j = share.energy_j

    def _close_segment(self) -> None:
        now = self.clock()
        duration = now - self._since
        self._since = now
        if duration <= 0 or not self.active:
            return
        total = sum(s.weight for s in self.active.values())
        parts = [(s, s.weight / total) for s in self.active.values()]
        for share, fraction in parts:
            share.device_s += duration * self.n_gpus * fraction
            share.pending += 1
        self._segments.append((duration, parts))


def gpu_context(collector: GpuCollector, on_up: Callable[[GpuCollector], None]) -> CleanupContext:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if await asyncio.to_thread(collector.start):
            on_up(collector)
        yield
        await asyncio.to_thread(collector.stop)

    return ctx
