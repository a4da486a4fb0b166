"""`tollbooth report --since`: dates are UTC whatever the time zone and its summer time."""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterator

import pytest

from sidecar.billing.report import parse_since

# Central European time with its summer rule, as a POSIX TZ string: needs no tz database.
BERLIN = "CET-1CEST,M3.5.0,M10.5.0/3"


@pytest.fixture
def summer_time_zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", BERLIN)
    time.tzset()
    assert time.localtime(calendar.timegm((2026, 7, 1, 12, 0, 0))).tm_isdst == 1
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize(
    "value,utc",
    [
        ("2026-07-01", (2026, 7, 1, 0, 0, 0)),  # summer: local time is UTC+2
        ("2026-01-15", (2026, 1, 15, 0, 0, 0)),  # winter: UTC+1
        ("2026-07-01T06:30:00", (2026, 7, 1, 6, 30, 0)),
        ("2026-03-29T02:30:00", (2026, 3, 29, 2, 30, 0)),  # a local time that does not exist
    ],
)
def test_dates_are_utc_in_a_summer_time_zone(
    summer_time_zone: None, value: str, utc: tuple[int, ...]
) -> None:
    assert parse_since(value) == calendar.timegm((*utc, 0, 0, 0))
