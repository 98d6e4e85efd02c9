"""A worker error that every replacement would repeat stops the run with that error's one
line, instead of a crash loop and a launcher traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from perdure import events as ev
from perdure.cli import main
from perdure.launch.local import LocalLauncher, WorkerCrashError, last_error
from tests.runtime_support import events, small_config

ERROR = "RuntimeError: this task cannot be built in a worker"


def test_the_last_traceback_line_written_since_an_offset_is_the_error(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    old = 'Traceback (most recent call last):\n  File "x", line 1\nValueError: old\n'
    new = "Traceback (most recent call last):\n  File \"y\", line 2\n    boom()\nKeyError: 'k'\n"
    log.write_text(old + "some output\n" + new)
    assert last_error(log) == "KeyError: 'k'"
    log.write_text(old)
    assert last_error(log, since=len(old)) is None  # a later process printed nothing


def test_two_start_up_crashes_with_the_same_error_stop_the_run(
    small_dataset: Path, tmp_path: Path
) -> None:
    cfg = small_config(small_dataset, task={"entry": "tests.worker_only_task:make_task"})
    t0 = time.monotonic()
    with pytest.raises(WorkerCrashError) as info:
        LocalLauncher(cfg, tmp_path, timeout_s=60).run()  # no preflight: straight to workers
    assert time.monotonic() - t0 < 45
    message = str(info.value)
    assert message.startswith(ERROR) and "\n" not in message
    assert f"{tmp_path}/logs/r0-" in message
    assert len(events(tmp_path, ev.PROCESS_EXIT)) == 2  # not three crashes per worker
    [failed] = events(tmp_path, ev.RUN_FAILED)
    assert failed["by"] == "launcher" and failed["reason"] == message


def test_perdure_run_prints_a_repeating_worker_error_in_one_line(
    small_dataset: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[task]\nentry = "tests.worker_only_task:make_task"\n'
        "options = { d_model = 32, n_layers = 1, n_heads = 2 }\n"
        "[train]\nsteps = 4\nglobal_batch = 16\nslots = 8\n"
        f'[data]\ndataset = "{small_dataset}"\n'
        '[cluster]\nregions = [{ name = "r0", workers = 2 }]\n'
    )
    args = ["run", str(path), "--run-dir", str(tmp_path / "run"), "--no-live", "--timeout-s", "60"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    [line] = res.output.strip().splitlines()
    assert line.startswith(f"run failed: {ERROR}") and "Traceback" not in res.output
