"""Fuzzing a real checkpoint: nothing loads with changed state, every failure is the
format's own error (loader with and without mmap, ``verify_checkpoint``, reference reader).

Each example copies a small committed checkpoint (one writer, or two with a split
tensor), applies one mutation from ``tests/checkpoint_fuzzing.py`` and runs every check.
The counts are printed in pytest's terminal summary (see ``conftest.py``); the seeded
script ``benchmarks/fuzz_checkpoint.py`` runs many more inputs for reports.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import checkpoint_fuzzing as fz

TALLY = fz.TALLY
_FUZZ = settings(
    max_examples=60,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, dict[str, str]]]:
    root = tmp_path_factory.mktemp("fuzz-bases")
    return [(b, fz.expected(b)) for b in fz.build_bases(root)]


def _judge(bases: list[tuple[Path, dict[str, str]]], which: int, kind: str, rnd) -> None:  # type: ignore[no-untyped-def]
    base, want = bases[which]
    with tempfile.TemporaryDirectory() as work:
        bad = fz.mutate_and_judge(base, want, Path(work), kind, rnd, TALLY)
    assert not bad, bad


def _fuzz(kinds: list[str], examples: int):  # type: ignore[no-untyped-def]
    """A hypothesis test over mutations ``kinds`` with a bounded number of examples."""

    @settings(_FUZZ, max_examples=examples)
    @given(
        which=st.integers(0, 1),
        kind=st.sampled_from(kinds),
        rnd=st.randoms(use_true_random=False),
    )
    def test(bases, which, kind, rnd) -> None:  # type: ignore[no-untyped-def]
        _judge(bases, which, kind, rnd)

    return test


test_raw_corruption_of_any_file_is_refused = _fuzz(["flip", "truncate", "extend", "digit"], 60)
test_resealed_manifest_damage_is_refused_or_loads_identical = _fuzz(
    ["digit_resealed", "raw_manifest_resealed", "whitespace"], 60
)
test_manifest_field_edits_are_refused_or_load_identical = _fuzz(
    ["edit_resealed", "edit_unsealed", "edit_legacy"], 150
)
test_context_and_header_edits_with_fixed_checksums_are_refused_or_load_identical = _fuzz(
    ["context", "header"], 80
)


def test_the_fuzz_tally_saw_no_traceback_and_no_silent_load() -> None:
    """Runs after the fuzz tests of this module (file order): the counts over all of them."""
    if TALLY.inputs == 0:
        pytest.skip("run with the fuzz tests above")
    print(TALLY.summary())
    bad = {v: TALLY.verdicts[v] for v in ("traceback", "silent load", "disagreement")}
    assert not any(bad.values()), (bad, TALLY.failures[:5])
