from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime_support import build_small_dataset, close_trainers


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_dataset(tmp_path_factory.mktemp("data") / "stdlib-small")


# -- the tiers --------------------------------------------------------------------------
#
# `make test-fast` runs the unit tier: the tests of modules that start no process (no
# run, no spawned rank, no subprocess, no namespace, no Ray), for the edit loop. A module
# is put in the integration tier by what its source calls (the hints below); in the unit
# tier a test that starts a process anyway fails at once, naming the call, so a module the
# hints miss is caught, not silently slow. `make test` (CI) runs both tiers.

_INTEGRATION_HINTS = re.compile(
    r"run_to_end|run_ranks|subprocess|multiprocessing|get_context|Popen|netns|\bray\b"
    r"|launch\.api|LocalLauncher|\bspawn|fresh_clone|\brun\(|invoke\(\s*\w+,\s*\[\s*\"run"
    r"|run_zygote|Zygote\(|step_runner\("
)

# Tests whose calls into perdure start a process the hints cannot see (a data build's
# workers, the C compiler of the fused kernels, git, a launcher behind the CLI): the unit
# tier's guard found them; a new one is added here the same way.
_STARTS_PROCESSES_INSIDE = frozenset(
    {
        "test_carried.py::test_received_exponents_that_are_not_small_integers_are_refused",
        "test_data_cli.py::test_build_into_an_existing_dir_fails_without_force",
        "test_data_cli.py::test_build_prints_the_version_id_and_inspect_shows_it",
        "test_data_cli.py::test_verify_passes_a_good_dataset_and_names_a_bad_part",
        "test_data_records.py::test_files_as_documents_are_the_same_on_two_processes",
        "test_data_records.py::test_one_and_two_processes_give_byte_identical_parts",
        "test_data_tokenizer.py::test_the_cli_builds_with_a_tokenizer_file_and_says_where_the_vocabulary_came_from",
        "test_dcp.py::test_a_dcp_checkpoint_missing_a_model_tensor_is_refused_naming_it",
        "test_dcp.py::test_a_dcp_checkpoint_of_another_shape_is_refused_naming_the_tensor",
        "test_dcp.py::test_a_directory_that_is_not_dcp_is_refused_naming_it",
        "test_dcp.py::test_the_import_cli_writes_step_0_and_names_the_resume_command",
        "test_dcp.py::test_weights_only_dcp_import_keeps_the_runs_fresh_optimizer",
        "test_exact_kernels.py::test_a_second_build_in_the_same_directory_reuses_the_first",
        "test_exact_kernels.py::test_preflight_of_an_exact_run_builds_the_kernels_before_any_worker_starts",
        "test_export.py::test_the_hf_example_exports_for_from_pretrained_bitwise",
        "test_launch_crash.py::test_perdure_run_prints_a_repeating_worker_error_in_one_line",
        "test_math_errors.py::test_a_non_finite_update_from_a_finite_gradient_is_a_math_error",
        "test_math_errors.py::test_a_sane_config_never_trips_the_check",
        "test_outer.py::test_a_replica_is_the_same_bits_in_any_order_and_leaves_the_outer_state_as_it_was",
        "test_outer.py::test_a_state_without_the_outer_momentum_is_refused_naming_it",
        "test_outer.py::test_a_kept_replica_is_copied_only_under_the_same_step_and_state_version",
        "test_outer.py::test_the_outer_step_is_torchs_nesterov_sgd_on_the_mean_pseudo_gradient",
        "test_outer.py::test_the_replicas_estimates_travel_in_the_state_and_a_state_without_them_is_refused",
        "test_outer.py::test_the_overlapped_delayed_step_moves_the_same_bits_and_an_undo_puts_the_state_back",
        "test_outer.py::test_a_delayed_outer_step_applies_the_previous_steps_mean_and_step_zero_moves_nothing",
        "test_outer.py::test_one_inner_sgd_step_and_a_plain_outer_step_are_the_synchronous_sgd_step",
        "test_netns_regions.py::test_the_delay_router_adds_the_asked_round_trip_between_regions_and_none_inside_one",
        "test_placement.py::test_a_checkpoint_records_the_placement_and_settings_in_force",
        "test_precision.py::test_an_overflow_at_the_minimum_scale_stops_the_run_naming_the_field",
        "test_precision.py::test_the_scale_is_state_in_a_checkpoint_and_a_state_copy_and_changes_only_by_an_update",
        "test_preflight.py::test_a_checkpoint_of_another_config_is_refused_naming_the_flag",
        "test_preflight.py::test_a_checkpoint_whose_tensors_do_not_fit_the_model_is_refused",
        "test_preflight.py::test_a_resume_checkpoint_with_a_flipped_bit_is_refused_naming_the_file",
        "test_provenance.py::test_outside_git_the_sha_is_explicitly_unknown",
        "test_recipes.py::test_a_changed_custom_optimizer_is_a_changed_run",
        "test_recipes.py::test_a_changed_dataset_is_a_changed_run",
        "test_recipes.py::test_a_compiled_model_checkpoints_with_the_plain_modules_keys",
        "test_recipes.py::test_the_preflight_computes_the_same_run_hash_as_every_worker",
        "test_runtime_runs.py::test_a_warm_up_pass_does_not_change_the_next_steps_bits",
        "test_streamed.py::test_received_exponents_that_are_not_an_int32_tensor_are_refused",
    }
)


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test's own code, its fixtures' or any function of its module they call
    (transitively) names a way to start a process."""
    todo: list[object] = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        todo += [d.func for d in (info.name2fixturedefs.get(name, ()) if info else ())]
    seen: set[int] = set()
    while todo:
        f = todo.pop()
        module = sys.modules.get(getattr(f, "__module__", "") or "")
        if not callable(f) or id(f) in seen or module is None:
            continue
        seen.add(id(f))
        if not module.__name__.startswith("tests.") or module.__name__ == __name__:
            continue  # this file's fixtures start nothing (the guard names what it refuses)
        try:
            source = inspect.getsource(f)  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue
        if _INTEGRATION_HINTS.search(source):
            return True
        code = getattr(f, "__code__", None)
        if code is not None:
            todo += [getattr(module, n, None) for n in code.co_names]
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = []
    for item in items:
        name = f"{Path(item.path).name}::{getattr(item, 'originalname', item.name)}"
        if name in _STARTS_PROCESSES_INSIDE or _starts_processes(item):
            item.add_marker(pytest.mark.integration)
            if Path(item.path).parent.name == "unit":
                misplaced.append(name)
    if misplaced:  # the folders say what a file's tests start: keep them true
        raise pytest.UsageError(
            "tests/unit/ holds tests that start no process; move these files to "
            f"tests/integration/: {sorted(misplaced)}"
        )
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts the same way
        _slowest_first(items)
        _scale_timeouts(config, items)


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n N`` a test shares the cores with N - 1 others: pytest-timeout's hang
    guards (``timeout`` in pyproject, ``@pytest.mark.timeout``) are N times as long. They
    bound a hang, not an outcome; two tests timed out at 120 s under -n 2 on a machine at
    load 12-20, each at its run's step 210 of 240 and 85 of 300, still training."""
    import os

    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    default = float(config.getini("timeout") or 0)
    for item in items if n > 1 else ():
        mark = item.get_closest_marker("timeout")
        base = (
            default
            if mark is None
            else float(mark.args[0] if mark.args else mark.kwargs["timeout"])
        )
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * n), append=False)


@pytest.fixture(autouse=True)
def _close_step_runners() -> Iterator[None]:
    """Close the trainers ``tests.runtime_support.step_runner`` built in the test."""
    yield
    close_trainers()


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the unit tier (``PERDURE_TEST_TIER=unit``), starting a process is an error."""
    import os

    if os.environ.get("PERDURE_TEST_TIER") != "unit":
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "a unit-tier test started a process: add its module's call to "
            "tests/conftest.py _INTEGRATION_HINTS"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


# -- parallel runs (pytest-xdist) --------------------------------------------------------
#
# `make test` runs the suite on 2 worker processes (`-n 2 --dist loadfile`): each test
# file is one unit of work for one worker, in file order, so a module-scoped fixture (a
# whole run that several tests read) runs once and a test that reads what an earlier one
# of its file left still sees it. `-n 0` runs everything in this process. What two tests
# running at once must not share is made unique per test (random namespace, bridge and
# veth names, port 0, tmp_path, a run directory's name where process titles are matched);
# see docs/testing.md.


# The slowest files first (from the "slowest 15 files" table of a serial run): each is one
# unit of work for one worker, and a long one handed out last would run alone at the end
# while the other worker idles. Only the order of handing out depends on this list (a
# stale one costs minutes, never a result); every other file keeps its collection order.
_SLOWEST_FIRST = (
    "test_chaos_runs.py",
    "test_exact_runs.py",
    "test_shard_params_runs.py",
    "test_shard_runs.py",
    "test_ray_launcher.py",
    "test_multihost.py",
    "test_diloco_runs.py",
    "test_runtime_runs.py",
)


def _slowest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.path).name, len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: add a finished worker's fuzz counts to this process's."""
    counts = getattr(node, "workeroutput", {}).get("checkpoint_fuzz")
    if counts:
        from tests import checkpoint_fuzzing

        checkpoint_fuzzing.TALLY.verdicts.update(counts)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The checkpoint fuzz counts (inputs, clean errors, tracebacks, silent loads), when
    the fuzz tests ran: a line to quote, without ``-s``. Under xdist this runs on the
    controller, whose counts are the workers' summed (:func:`pytest_testnodedown`)."""
    fuzz = sys.modules.get("tests.checkpoint_fuzzing")
    if fuzz is not None and fuzz.TALLY.inputs:
        terminalreporter.write_line(fuzz.TALLY.summary())
    _slowest_files(terminalreporter)


def _slowest_files(terminalreporter: pytest.TerminalReporter, n: int = 15) -> None:
    """The files that took longest (setup, call and teardown of all their tests): where a
    suite that grew too slow can be cut."""
    per: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport):
                path = r.nodeid.split("::", 1)[0]
                per[path] = per.get(path, 0.0) + r.duration
    if len(per) < 2:
        return
    terminalreporter.write_sep("=", f"slowest {n} files")
    for path, seconds in sorted(per.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")


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
    # In an xdist worker: hand this worker's checkpoint fuzz counts to the controller,
    # which prints the sum (a worker's own terminal summary is shown nowhere). xdist
    # sends ``workeroutput`` after every sessionfinish hook, this one included.
    workeroutput = getattr(session.config, "workeroutput", None)
    fuzz = sys.modules.get("tests.checkpoint_fuzzing")
    if workeroutput is not None and fuzz is not None and fuzz.TALLY.inputs:
        workeroutput["checkpoint_fuzz"] = dict(fuzz.TALLY.verdicts)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import sys

    if os.environ.get("PERDURE_TEST_TEARDOWN") == "1" or not _status:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[-1])
