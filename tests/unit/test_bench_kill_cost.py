"""The pure parts of benchmarks/bench_kill_cost.py: a kill's cost against the clean run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_kill_cost import COST_WINDOW, against_clean


def _metrics(gaps: dict[int, float], steps: int) -> list[dict]:
    t, out = 0.0, []
    for s in range(steps):
        t += gaps.get(s, 1.0)
        out.append({"step": s, "t": t})
    return out


def test_a_kills_cost_is_its_window_against_the_clean_runs_same_steps() -> None:
    """A fingerprint step slow in both runs costs nothing; the faulty run's extra 2 s
    in the window (a stall, then a spread copy) costs 2 clean step times."""
    clean = _metrics({30: 2.5}, 100)
    faulty = _metrics({30: 2.5, 20: 2.0, 21: 1.5, 25: 1.5}, 100)
    assert against_clean(faulty, clean, [20]) == pytest.approx([2.0])
    assert against_clean(faulty, clean, [20 + COST_WINDOW]) == pytest.approx([0.0])
    assert against_clean(faulty, clean, [95]) == []  # its window runs past the run
