"""`tollbooth report --format html` (issue 25): one self-contained page whose tables add up to the
ledger by every dimension, whose ledger strings are text (hostile names included), and which
headless Chromium renders with its charts and every group, fetching nothing."""

from __future__ import annotations

import calendar
import hashlib
import subprocess
import sys
from decimal import Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.billing import chargeback, charts, ledger, report
from sidecar.billing.idle import IDLE, Capacity
from tests.browser import Browser, browser, png_pixels, png_size

NOV_1 = calendar.timegm((2026, 11, 1, 0, 0, 0))
DEC_1 = calendar.timegm((2026, 12, 1, 0, 0, 0))
DAY = 86400
# Outside input, as a gateway or a client may set it: each must reach the page as text.
H_USER = '<script>alert("u")</script>'
H_TEAM = '"><img src=x onerror=alert(1)>'
H_PROJECT = "</table><svg onload=alert(2)>"
H_MODEL = "m<1>&amp;"
H_TAGS = "=1+2,a&b"  # sorted, comma-joined: a formula to a spreadsheet, an entity to HTML
HOSTILE = [H_USER, H_TEAM, H_PROJECT, H_MODEL, "=1+2", "a&b"]
# (ts, user, team, project, tags, model, input, output, cost, device_s, device_cost): costs are
# whole multiples of $0.0001, so the page's 4 decimals are exact; device cost at $3.60/GPU-h.
ROWS = [
    (NOV_1 + 3600, "ann", "ops", "atlas", "eu,prod", "llama", 1000, 500, 0.25, 10.0, 0.01),
    (NOV_1 + 7200, "bob", "ml", "zeus", None, "qwen", 2000, 1000, 1.5, 20.0, 0.02),
    (NOV_1 + DAY + 60, H_USER, H_TEAM, H_PROJECT, H_TAGS, H_MODEL, 100, 100, 0.0125, 5.0, 0.005),
    (NOV_1 + DAY + 120, "ann", "ops", None, "prod", "llama", 500, 500, 0.5, 8.0, 0.008),
    (NOV_1 + 2 * DAY, "bob", "ml", "zeus", "eu", "qwen", 300, 200, None, 2.0, 0.002),  # unknown
    (NOV_1 + 2 * DAY + 5, "cy", None, "atlas", None, "llama", 10, 10, 0.0004, None, None),
]
GPUS = Capacity(1, "--gpus")
# All the page is made of: nothing that runs, links or fetches.
ELEMENTS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "div", "table"}
ELEMENTS |= {"thead", "tbody", "tr", "th", "td", "svg", "rect", "text", "line"}


@pytest.fixture
def path(tmp_path: Path) -> str:
    p = tmp_path / "l.db"
    conn = ledger.connect(p)
    with conn:
        for i, (ts, user, team, project, tags, model, inp, out, cost, ds, dc) in enumerate(ROWS):
            conn.execute(
                ledger.INSERT,
                ledger.Row(ts, f"r{i}", None, model, "/v1/chat/completions", user, inp, 0, out,
                           cost, "200", 0, None, None, 0.1, None, team, None, ds, None, dc,
                           project=project, tags=tags),
            )  # fmt: skip
    conn.close()
    return str(p)


def build(path: str, by: str, spread: bool = False) -> chargeback.Report:
    return chargeback.build(path, NOV_1, DEC_1, by, gpus=GPUS, spread_idle=spread, now=DEC_1)


class Page(HTMLParser):
    """Every element and attribute of a page, the text of its tables, and of its SVG charts."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def rows(self, table: str) -> list[dict[str, str]]:
        head, *body = self.tables[table]
        return [dict(zip([h.replace(" ", "_") for h in head], r, strict=True)) for r in body]

    def count(self, tag: str, cls: str) -> int:
        return sum(
            1 for t, a in self.elements if t == tag and cls in (a.get("class") or "").split()
        )


def expected(by: str) -> dict[str, list[tuple[Any, ...]]]:
    """The ledger's rows by group, computed here from ROWS, not by the report."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in ROWS:
        for k in report.keys_of(r, by, 0):
            out.setdefault(k, []).append(r)
    return out


def money(rows: list[tuple[Any, ...]], col: int) -> str:
    values = [r[col] for r in rows]
    if col == 10 and all(v is None for v in values):
        return "unknown"
    if any(v is None for v in values) and col == 8:
        return "unknown"
    return f"${sum(Decimal(str(v)) for v in values if v is not None):.4f}"


@pytest.mark.parametrize("by", report.DIMENSIONS)
def test_the_html_tables_add_up_to_the_ledger(path: str, by: str) -> None:
    page = Page(chargeback.render(build(path, by), "html"))
    groups = page.rows("groups")
    assert groups[-1][by] == IDLE  # the idle line, last
    got = {g[by]: g for g in groups[:-1]}
    want = expected(by)
    assert set(got) == set(want)
    for name, rows in want.items():
        g = got[name]
        assert int(g["requests"]) == len(rows)
        assert int(g["input_tokens"]) == sum(r[6] for r in rows)
        assert int(g["output_tokens"]) == sum(r[7] for r in rows)
        assert g["cost_usd"] == money(rows, 8)  # unknown where any request's cost is unknown
        assert g["device_cost_usd"] == money(rows, 10)
    if by != "tag":  # by tag a request is in each of its tags
        assert sum(int(g["requests"]) for g in groups) == len(ROWS)
        known = sum(Decimal(g["cost_usd"][1:]) for g in groups if g["cost_usd"] != "unknown")
        unknown_groups = {k for k, g in got.items() if g["cost_usd"] == "unknown"}
        in_unknown = [r for k in unknown_groups for r in want[k]]
        assert known == sum(
            Decimal(str(r[8])) for r in ROWS if r[8] is not None and r not in in_unknown
        )
    daily = page.rows("daily")
    assert [d["day"] for d in daily] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    known_total = sum(Decimal(str(r[8])) for r in ROWS if r[8] is not None)
    if by != "tag":
        assert sum(Decimal(d["total"][1:]) for d in daily) == known_total


def test_the_page_names_its_period_price_book_and_idle_line(path: str, tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("default: {input_per_1m: 1, output_per_1m: 2}\ngpu_hour_usd: 3.6\n")
    book = chargeback.price_book(str(prices), None)
    rep = chargeback.build(path, NOV_1, DEC_1, "team", book=book, gpus=GPUS, now=DEC_1)
    text = chargeback.render(rep, "html")
    digest = hashlib.sha256(prices.read_bytes()).hexdigest()
    assert f"Price book: pricing file {prices} (sha256 {digest})" in text
    assert "2026-11-01 00:00 UTC to 2026-12-01 00:00 UTC" in text
    used = sum(r[9] for r in ROWS if r[9] is not None)
    idle_s = 30 * DAY - used
    idle = next(r for r in Page(text).rows("groups") if r["team"] == IDLE)
    assert idle["device_seconds"] == f"{idle_s:.3f}"
    assert idle["device_cost_usd"] == f"${idle_s / 3600 * 3.6:.4f}"
    unknown = chargeback.render(build(path, "team"), "html")
    assert "Price book: unknown." in unknown


@pytest.mark.parametrize("by", ["user", "team", "project", "tag", "model"])
def test_ledger_strings_are_text_in_the_page(path: str, by: str) -> None:
    text = chargeback.render(build(path, by, spread=True), "html")
    for name in HOSTILE:
        if name in {str(k) for k in expected(by)} and any(c in name for c in '<>&"'):
            assert name not in text
    page = Page(text)
    assert {t for t, _ in page.elements} <= ELEMENTS
    attrs = {a for _, at in page.elements for a in at}
    assert not {a for a in attrs if a.startswith("on")} and not attrs & {"src", "href"}
    names = {r[by] for r in page.rows("groups")}
    assert {str(k) for k in expected(by)} <= names  # the names, as text, unchanged
    assert text.count("://") == text.count('xmlns="http://www.w3.org/2000/svg"')  # no URL
    assert "url(" not in text and "@import" not in text


def test_no_spreadsheet_formula_in_the_csv(path: str) -> None:
    text = chargeback.render(build(path, "tag"), "csv")
    lines = text.splitlines()
    assert "'=1+2" in {line.split(",")[0] for line in lines}
    assert not any(line.startswith(("=", "+", "@")) for line in lines)


@pytest.fixture
def chromium(tmp_path: Path) -> Any:
    with browser(tmp_path) as b:
        yield b


def test_the_watch_sees_a_page_fetch(chromium: Browser, tmp_path: Path) -> None:
    page = tmp_path / "fetches.html"
    page.write_text('<!DOCTYPE html><img src="http://tollbooth-probe.invalid/x.png">')
    chromium.dump_dom(page)
    assert chromium.fetched() == ["GET http://tollbooth-probe.invalid/x.png HTTP/1.1"]


@pytest.mark.parametrize("by", report.DIMENSIONS)
def test_chromium_shows_the_charts_and_every_group(
    chromium: Browser, path: str, tmp_path: Path, by: str
) -> None:
    file = tmp_path / f"{by}.html"
    file.write_text(chargeback.render(build(path, by, spread=True), "html"), encoding="utf-8")
    dom = Page(chromium.dump_dom(file))
    assert chromium.fetched() == []  # nothing from the network, not even a font
    assert dom.count("svg", "chart") == 4  # per day, top spenders, per 1k tokens, device cost
    assert dom.count("svg", "stacked") == 1
    bars = [a.get("data-group") for t, a in dom.elements if t == "rect" and a.get("class") == "bar"]
    assert len(bars) >= len(ROWS)
    assert {t for t, _ in dom.elements}.isdisjoint({"script", "img", "iframe", "object"})
    shown = [r[by] for r in dom.rows("groups")]
    assert shown == [*[str(g[by]) for g in build(path, by).groups], IDLE]
    assert {str(k) for k in expected(by)} == set(shown[:-1])


def test_a_screenshot_of_the_page(chromium: Browser, path: str, tmp_path: Path) -> None:
    file = tmp_path / "team.html"
    file.write_text(chargeback.render(build(path, "team", spread=True), "html"), encoding="utf-8")
    shot = tmp_path / "team.png"
    chromium.screenshot(file, shot, 1280, 1800)
    assert png_size(shot) == (1280, 1800)
    assert chromium.fetched() == []
    pixels = png_pixels(shot)
    rgb = [tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in charts.PALETTE[:3]]
    # each legend key is 12 x 12 pixels, in two charts: 288 of each colour without any bar
    assert all(pixels[c] > 288 for c in rgb), [pixels[c] for c in rgb]  # type: ignore[index]
    assert pixels[rgb[0]] >= 2000  # type: ignore[index]  # the top group's bars: measured 14114


def test_the_cli_writes_the_page(path: str, tmp_path: Path) -> None:
    out = tmp_path / "nov.html"
    args = ["report", "--ledger", path, "--month", "2026-11", "--by", "project", "--gpus", "1"]
    subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", *args, "--format", "html", "-o", str(out)],
        check=True,
        timeout=60,
    )
    rows = Page(out.read_text(encoding="utf-8")).rows("groups")
    assert [r["project"] for r in rows] == [
        *[str(g["project"]) for g in build(path, "project").groups],
        IDLE,
    ]


NAMES = st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(users=st.lists(NAMES, min_size=1, max_size=4, unique=True), model=NAMES)
def test_any_name_is_text_in_the_page(users: list[str], model: str) -> None:
    rows = [
        (NOV_1 + i, u, None, None, None, model, 1, 1, 0.5, 0.1, 2.0, 0.002)
        for i, u in enumerate(users)
    ]
    groups = report.group_rows(rows, "user")
    idle = chargeback.idle_mod.measure(rows, 100.0, GPUS, None, "unknown")
    rep = chargeback.Report("user", NOV_1, NOV_1 + 100, chargeback.PriceBook(), groups, idle, False)
    rep.daily, rep.models = chargeback._daily(rows, "user", 0), report.group_rows(rows, "model")
    page = Page(chargeback.render(rep, "html"))
    assert {t for t, _ in page.elements} <= ELEMENTS
    assert [r["user"] for r in page.rows("groups")] == [*[g["user"] for g in groups], IDLE]
    assert [r["model"] for r in page.rows("models")] == [model]
