from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime_support import build_small_dataset


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_dataset(tmp_path_factory.mktemp("data") / "stdlib-small")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The checkpoint fuzz counts (inputs, clean errors, tracebacks, silent loads), when
    the fuzz tests ran: a line to quote, without ``-s``."""
    import sys

    fuzz = sys.modules.get("tests.checkpoint_fuzzing")
    if fuzz is not None and fuzz.TALLY.inputs:
        terminalreporter.write_line(fuzz.TALLY.summary())
