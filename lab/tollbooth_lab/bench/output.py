"""What the harness writes: result.json, report.md and latency.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_all(result: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "result.json", out_dir / "report.md", out_dir / "latency.png"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths


def _ms(v: float | None) -> str:
    return "unknown" if v is None else f"{v * 1000:.1f}"


def _usd(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.6f}"


def markdown(result: dict[str, Any]) -> str:
    c = result["conditions"]
    lines = [
        "# Scheduling comparison",
        "",
        f"Model `{c['model']}` via {c['upstream']}; arrival: {c['arrival']}; "
        f"{c['measured_requests']} measured requests after {c['warmup_requests']} warm-up; "
        f"tollbooth {c['tollbooth_version']}, {c['taken_at']}.",
        "",
        "Queue and TTFT are the sidecar's measurements (TTFT: upstream send to first token, "
        "without the queue); e2e is the client's. Times in ms. `unknown` = not measured. "
        "Device $/1k tokens: GPU-seconds attributed from NVML x pricing.gpu_hour_usd.",
        "",
        "| strategy | requests | failures | queue p50 | queue p99 | TTFT p50 | TTFT p99 | "
        "e2e p50 | e2e p90 | e2e p99 | tokens/s | $/1k tokens | device $/1k tokens | "
        "outputs agree | attempts |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, s in result["strategies"].items():
        cost, device = s["cost_per_1k_tokens_usd"], s["cost_per_1k_tokens_device_usd"]
        tps = "unknown" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
        agree = {True: "yes", False: "NO", None: "n/a"}[s["outputs_consistent"]]
        lines.append(
            f"| {name} | {s['requests']} | {s['failures']} | {_ms(s['queue_s']['p50'])} | "
            f"{_ms(s['queue_s']['p99'])} | {_ms(s['ttft_s']['p50'])} | {_ms(s['ttft_s']['p99'])} "
            f"| {_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p90'])} | {_ms(s['e2e_s']['p99'])} | "
            f"{tps} | "
            f"{_usd(cost)} | {_usd(device)} | {agree} | {len(s['attempts'])} |"
        )
    for name, s in result["strategies"].items():
        for a in s["attempts"]:
            if a.get("oom_report"):
                lines.append(
                    f"\n- `{name}` attempt {a['attempt']}: out of memory in "
                    f"{a['oom_failures']} requests; see `{a['oom_report']}`."
                )
    if result["output_mismatches"]:
        lines.append(
            f"\n{len(result['output_mismatches'])} outputs differ from the reference "
            "strategy (listed in result.json)."
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["strategies"])
    phases = [("queue_s", "queue"), ("ttft_s", "TTFT"), ("e2e_s", "completion (e2e)")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=False)
    for ax, (key, title) in zip(axes, phases, strict=True):
        width = 0.25
        for i, pct in enumerate(("p50", "p90", "p99")):
            vals = [result["strategies"][n][key][pct] for n in names]
            xs = [j + (i - 1) * width for j in range(len(names))]
            ax.bar(xs, [0 if v is None else v * 1000 for v in vals], width, label=pct)
            for x, v in zip(xs, vals, strict=True):
                if v is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_title(title)
        ax.set_ylabel("ms")
    axes[0].legend()
    c = result["conditions"]
    fig.suptitle(f"Latency by scheduling strategy: {c['model']}, {c['arrival']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
