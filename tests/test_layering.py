"""The packages' import order: base < telemetry < metering < billing < proxy < core.

Every import in `sidecar/` (at the top, inside functions and under TYPE_CHECKING alike) is read
from the source with `ast`, so a lazy import cannot hide a dependency against the order. The lab
(simulator, bench, demo) is a separate distribution: the server never imports it, nor the plotting
and dashboard libraries.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar"
BASE = {"sidecar", "sidecar.config", "sidecar.text", "sidecar.exchange", "sidecar.credentials"}
ORDER = ["base", "telemetry", "metering", "billing", "proxy", "core"]
# The one place the lab is reached from: `tollbooth demo|simulate|bench`, inside the functions
# (lazily, with a clear error when the lab is not installed).
LAB_USERS = {"sidecar.core.commands"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    name = module.split(".")[1]
    if name not in ORDER:
        raise AssertionError(f"{module} is in no layer: put it in a package or in BASE")
    return name


def imports(path: Path, here: str) -> list[tuple[int, str, ast.stmt]]:
    """(line, absolute module, the statement) for each import of the file."""
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    out: list[tuple[int, str, ast.stmt]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + [target] * bool(target))
            for a in node.names:  # `from . import x` imports the submodule x
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if is_module(sub) else target, node))
    return out


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def against_the_order(path: Path, here: str) -> list[str]:
    mine = ORDER.index(layer(here))
    wrong = []
    for line, target, _ in imports(path, here):
        if target != "sidecar" and not target.startswith("sidecar."):
            continue
        rank = ORDER.index(layer(target))
        if rank > mine or (mine == 0 and rank != 0):
            wrong.append(f"{path.name}:{line} imports {target} ({layer(target)} > {layer(here)})")
    return wrong


MODULES = sorted(SIDECAR.rglob("*.py"))
IDS = [str(p.relative_to(ROOT)) for p in MODULES]


def test_every_module_is_found() -> None:
    names = {module_name(p) for p in MODULES}
    assert {"sidecar.exchange", "sidecar.proxy.handler", "sidecar.core.app"} <= names
    # the lab left the package (written as paths, so rewrite scripts leave these names alone)
    assert not any((SIDECAR / name).exists() for name in ("simulator", "bench", "demo.py"))


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_imports_point_down_the_layers(path: Path) -> None:
    assert against_the_order(path, module_name(path)) == []


def test_the_layering_check_sees_a_wrong_import_even_a_lazy_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from ..config import Config\n\ndef f():\n    from ..proxy import handler\n")
    assert against_the_order(probe, "sidecar.telemetry.probe") == [
        "probe.py:4 imports sidecar.proxy.handler (proxy > telemetry)"
    ]
    assert against_the_order(probe, "sidecar.core.probe") == []


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_the_lab_is_reached_only_lazily_from_the_commands(path: Path) -> None:
    here = module_name(path)
    top = ast.parse(path.read_text()).body
    found = [
        f"{path.name}:{line}"
        for line, target, node in imports(path, here)
        if target.split(".")[0] == "tollbooth_lab"
        # inside a function, or under `if TYPE_CHECKING:` (for the type checker only)
        and (here not in LAB_USERS or any(node is n for n in top))
    ]
    assert found == []


SERVER_MUST_NOT_LOAD = ("tollbooth_lab", "matplotlib", "numpy", "grafanalib")


def test_the_server_imports_nothing_of_the_lab_nor_plotting_or_dashboard_libraries() -> None:
    code = (
        "import sys, sidecar.core.app, sidecar.core.wiring, sidecar.core.cli;"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_MUST_NOT_LOAD!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out.strip() == "[]"
