"""Render every dashboards/*.dashboard.py into dashboards/generated/*.json.

`python -m dashboards.build [--thresholds FILE]`. The generated files are committed so the stack
starts without Python; a test regenerates them and fails on any difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from grafanalib._gen import DashboardEncoder

from dashboards.lib import finish
from sidecar.telemetry import thresholds

HERE = Path(__file__).parent
OUT = HERE / "generated"


def sources() -> list[Path]:
    return sorted(HERE.glob("*.dashboard.py"))


def render(source: Path, t: thresholds.Thresholds) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(source.stem.replace(".", "_"), source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    data = json.loads(json.dumps(module.build(t).to_json_data(), cls=DashboardEncoder))
    return finish(data, t)


def render_all(t: thresholds.Thresholds) -> dict[str, str]:
    return {
        src.name.replace(".dashboard.py", ".json"): json.dumps(
            render(src, t), indent=2, sort_keys=True
        )
        + "\n"
        for src in sources()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--thresholds", help="YAML of threshold overrides for this deployment")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    for name, text in render_all(thresholds.load(args.thresholds)).items():
        (OUT / name).write_text(text)
        print(f"wrote dashboards/generated/{name}")


if __name__ == "__main__":
    main()
