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


# -- the end of the test process ---------------------------------------------------------
#
# Once pytest has written its summary, the process exits with pytest's status without the
# interpreter's teardown. That teardown has hung once (a full run printed its result, then
# never exited) and crashed once (841 passed, then a segfault with no stack) in clean-clone
# runs: native threads of torch.distributed objects that tests leave to the garbage
# collector (gloo pairs, store clients) outlive the interpreter's state. Neither is a test's
# outcome, and either would fail CI after every test passed. To chase the crash itself, set
# PERDURE_TEST_TEARDOWN=1: the teardown then runs, under ``make test``'s
# ``-X faulthandler``, which prints every thread's stack if it crashes.

_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import sys

    if os.environ.get("PERDURE_TEST_TEARDOWN") == "1" or not _status:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[-1])
