"""The report's human units and scales (spark/report.py), without Spark."""

from __future__ import annotations

import base64
import re

import pytest

from fencemq.spark import report


@pytest.mark.parametrize(("ms", "text"), [
    (0, "0 ms"), (850, "850 ms"), (4_200, "4.2 s"), (240_380, "4 min 0 s"), (7_500_000, "2 h 5 min"),
    (273_600_000, "3 d 4 h"),
])
def test_durations_read_as_durations(ms: int, text: str) -> None:
    assert report.duration(ms) == text


@pytest.mark.parametrize(("n", "text"), [
    (7, "7"), (9_999, "9,999"), (12_345, "12.3 k"), (1_234_567, "1.2 M"), (250_000_000, "250 M"),
    (3_400_000_000, "3.4 G"),
])
def test_counts_read_in_thousands_millions_billions(n: int, text: str) -> None:
    assert report.count(n) == text


def test_a_table_shows_ages_as_durations_instants_as_utc_and_counts_in_units() -> None:
    html = report._table([{"max_oldest_unacked_age_ms": 240_380, "last_ms": 1_790_000_000_000,
                           "backlog": 1_234_567, "epoch": 12_345}])
    assert "<td class=n>4 min 0 s</td>" in html
    assert "<td>2026-09-21T14:13:20Z</td>" in html
    assert "<td class=n>1.2 M</td>" in html and "<td class=n>12345</td>" in html  # an epoch is a name


def test_values_spanning_two_orders_of_magnitude_get_a_log_scale() -> None:
    assert report.wants_log_scale([1_000_000, 40, 3, 1])  # rare events stay visible
    assert not report.wants_log_scale([12, 10, 4, 1])
    assert not report.wants_log_scale([0, 0])


def test_a_plot_is_an_inline_png() -> None:
    pytest.importorskip("matplotlib")
    fig = report.Plots().bar("deliveries", ["1", "2", "16"], [1_000_000, 40, 1], "messages", horizontal=False)
    src = re.search(r"src='data:image/png;base64,([^']+)'", fig)
    assert src and base64.b64decode(src.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
