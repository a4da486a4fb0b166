"""GPU and efficiency: what the serving team tunes against."""

from grafanalib.core import Dashboard

from dashboards.lib import (
    FILTER,
    NOT_REASONING,
    USD_PER_HOUR,
    Grid,
    dashboard,
    stat,
    target,
    text,
    timeseries,
)
from sidecar.telemetry.thresholds import Thresholds


def build(t: Thresholds) -> Dashboard:
    g = Grid()
    gpu = 'job="$job",instance=~"$instance"'
    panels = [
        stat(
            g,
            "GPU telemetry",
            "llm_gpu_telemetry_up: 1 while the sidecar reads NVML. 0 when there is no NVML, no "
            "driver or no GPU (the simulator, a CPU host) or gpu.enabled is false: then every "
            "GPU panel here stays empty, and nothing is estimated in its place.",
            "none",
            [target(f"min(llm_gpu_telemetry_up{{{gpu}}})")],
            no_value="sidecar not scraped",
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "Off: no NVML", "color": "orange", "index": 0},
                        "1": {"text": "On", "color": "green", "index": 1},
                    },
                }
            ],
        ),
        text(
            g,
            "Why these panels can be empty",
            "GPU readings come from NVML on the sidecar's host. **When *GPU telemetry* says "
            "*Off*, no NVML is present** (or `gpu.enabled` is false): utilisation, memory, "
            "power, temperature, energy and device time have no series at all, by design; "
            "they are never filled with zeros or estimates. Token counts and spend do not "
            "depend on it. See docs/metrics.md, *GPU telemetry and attribution*.",
            w=18,
            h=6,
        ),
        timeseries(
            g,
            "GPU utilisation",
            "NVML busy ratio per GPU. No series when telemetry is "
            "off (no NVML): never a fake zero.",
            "percentunit",
            [target(f"llm_gpu_utilization_ratio{{{gpu}}}", "GPU {{gpu}}")],
        ),
        timeseries(
            g,
            "GPU memory used",
            "Memory used / total per GPU; the line is the LLMGPUMemoryNearFull threshold.",
            "percentunit",
            [
                target(
                    f"llm_gpu_memory_used_bytes{{{gpu}}} / llm_gpu_memory_total_bytes{{{gpu}}}",
                    "GPU {{gpu}}",
                )
            ],
            threshold=t.gpu_memory_ratio,
        ),
        timeseries(
            g,
            "Power draw",
            "Board power per GPU (NVML reports mW; shown in W).",
            "watt",
            [target(f"llm_gpu_power_watts{{{gpu}}}", "GPU {{gpu}}")],
        ),
        timeseries(
            g,
            "Output tokens per second",
            "Generated tokens per second, to read against power and utilisation.",
            "short",
            [
                target(
                    f'sum(rate(llm_tokens_total{{{FILTER},token_type="output"}}'
                    "[$__rate_interval]))",
                    "tokens/s",
                )
            ],
        ),
        timeseries(
            g,
            "Tokens per GPU-second",
            "All tokens divided by the GPU-seconds attributed to requests.",
            "short",
            [
                target(
                    f"sum by (model) (rate(llm_tokens_total{{{FILTER},{NOT_REASONING}}}"
                    "[$__rate_interval]))"
                    f" / sum by (model) (rate(llm_device_seconds_total{{{FILTER}}}"
                    "[$__rate_interval]))",
                    "{{model}}",
                )
            ],
        ),
        timeseries(
            g,
            "Device cost vs token-price cost",
            "Infrastructure view (GPU-hours x "
            "gpu_hour_usd) beside the per-token price view, per hour.",
            USD_PER_HOUR,
            [
                target(
                    f"sum(rate(llm_device_cost_usd_total{{{FILTER}}}[$__rate_interval])) * 3600",
                    "device time",
                ),
                target(
                    f"sum(rate(llm_cost_usd_total{{{FILTER}}}[$__rate_interval])) * 3600",
                    "token prices",
                    "B",
                ),
            ],
        ),
        timeseries(
            g,
            "Energy per 1k tokens",
            "Joules attributed to requests per thousand tokens (needs the NVML energy counter).",
            "joule",
            [
                target(
                    f"sum by (model) (rate(llm_energy_joules_total{{{FILTER}}}"
                    f"[$__rate_interval])) / sum by (model) (rate(llm_tokens_total"
                    f"{{{FILTER},{NOT_REASONING}}}[$__rate_interval])) * 1000",
                    "{{model}}",
                )
            ],
        ),
        timeseries(
            g,
            "GPU temperature",
            "Per GPU.",
            "celsius",
            [target(f"llm_gpu_temperature_celsius{{{gpu}}}", "GPU {{gpu}}")],
        ),
    ]
    return dashboard(
        t,
        "tollbooth-gpu",
        "Tollbooth / GPU and efficiency",
        "NVML readings joined with token counts.",
        panels,
    )
