"""Sharded initialisation (``task.init = "per_module"``) and checkpoints loaded by shard:
with the parameters sharded at rest a worker never holds the whole model, whether it
starts from the seed or from a checkpoint, and the bits are the same for every layout."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from perdure import events as ev
from perdure.launch.preflight import PreflightError, preflight
from perdure.run_config import RunConfig
from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.swarm import CopyJob, SwarmCopy
from perdure.runtime.member.shard_group import Shards, optimizer_params
from perdure.runtime.replica.deferred import resident
from perdure.runtime.replica.trainer import Trainer
from perdure.runtime.shard_plan import ALL, NONE
from tests.runtime_support import events, run_to_end, sharded_config, small_config, summary

STEPS = 20
T = timedelta(seconds=30)


def _cfg(dataset: Path, workers: int, k: int, init: str = "per_module", **kw: Any) -> RunConfig:
    return sharded_config(dataset, workers, k, steps=STEPS, init=init, **kw)


@pytest.fixture(scope="module")
def per_module_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One worker, initialised per module: the reference bits."""
    run_dir = tmp_path_factory.mktemp("per_module") / "run"
    run_to_end(_cfg(small_dataset, 1, 1), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def at_rest_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four workers in two groups of two, parameters sharded at rest, initialised per
    module: each makes only its own shard."""
    run_dir = tmp_path_factory.mktemp("at_rest") / "run"
    run_to_end(_cfg(small_dataset, 4, 2), run_dir)
    return run_dir


def _hash(run_dir: Path) -> str:
    return str(summary(run_dir)["final_hash"])


def _first_epoch(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    first = events(run_dir, ev.EPOCH_STARTED)[0]["epoch"]
    return [e for e in events(run_dir, kind) if e["epoch"] == first]


def test_per_module_initialisation_gives_every_layout_the_same_bits_and_a_run_of_its_own(
    per_module_run: Path, at_rest_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """One worker, two groups of two at rest, one group of two with whole parameters:
    one final hash; the eager initialisation's is another (a math setting)."""
    want = _hash(per_module_run)
    assert _hash(at_rest_run) == want
    whole = run_to_end(_cfg(small_dataset, 2, 2, train={"shard_params": False}), tmp_path / "w")
    assert whole["final_hash"] == want
    eager = run_to_end(_cfg(small_dataset, 1, 1, init="eager"), tmp_path / "eager")
    assert eager["final_hash"] != want


def test_a_rank_initialised_per_module_never_holds_more_than_its_shard(
    at_rest_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """The most parameter bytes a rank held before its first slot is its own shard's
    (here each module's parameters are one shard's, so nothing more); built eagerly,
    every rank held the whole model first."""
    rest = _first_epoch(at_rest_run, ev.PARAMS_AT_REST)
    assert len(rest) == 4
    for e in rest:
        assert e["init_peak_bytes"] == e["bytes"] < 0.6 * e["of"], e
    eager_dir = tmp_path / "eager"
    run_to_end(_cfg(small_dataset, 4, 2, init="eager"), eager_dir)
    for e in _first_epoch(eager_dir, ev.PARAMS_AT_REST):
        assert e["init_peak_bytes"] == e["of"], e


@pytest.mark.parametrize("workers,k", [(4, 2), (4, 4), (1, 1)])
def test_a_checkpoint_resumed_at_rest_is_read_by_shard_on_the_same_trajectory(
    per_module_run: Path,
    at_rest_run: Path,
    small_dataset: Path,
    tmp_path: Path,
    workers: int,
    k: int,
) -> None:
    """The step-10 checkpoint of the k = 2 run, resumed with k = 2, 4 and 1: the same
    final hash; sharded at rest, a rank reads only its shard's parameters."""
    ckpt = at_rest_run / "checkpoints" / f"step-{STEPS // 2:09d}"
    run_dir = tmp_path / "resumed"
    s = run_to_end(_cfg(small_dataset, workers, k), run_dir, resume=str(ckpt))
    assert s["final_hash"] == _hash(per_module_run)
    for e in _first_epoch(run_dir, ev.PARAMS_AT_REST):
        assert e["init_peak_bytes"] == e["bytes"] < e["of"], e


def test_a_killed_rank_initialised_per_module_is_absorbed_and_changes_no_bit(
    per_module_run: Path, small_dataset: Path, tmp_path: Path
) -> None:
    kill = [{"kind": "kill", "target": "r0-0", "at_step": STEPS // 3}]
    s = run_to_end(_cfg(small_dataset, 4, 2, chaos={"faults": kill}), tmp_path / "run")
    assert s["final_hash"] == _hash(per_module_run)
    assert [e["worker"] for e in events(tmp_path / "run", ev.LEAVE)] == ["r0-0"]


# -- a pending replica as the source of a shard it does not keep -------------------------


def _copied_to_rank_1(tr: Trainer, comm: Comm, proc: int) -> int:
    """Rank 0's state copied to rank 1 as the worker does it (``_transfer``); what each
    rank then holds."""
    job = CopyJob(
        receivers=(1,),
        source=0,
        shard_degree=2,
        layout=tr.copy_layout(),
        offer=tr.export() if proc == 0 else None,
        target=tr.copy_target(comm.device) if proc == 1 else None,
        timeout=T,
    )
    got = SwarmCopy().copy(comm, job)
    if got is None:
        return ALL
    tr.adopt(got.model, got.optimizer, got.extra)
    return tr.held


def _joined_as_the_worker_does(tr: Trainer, port: int, proc: int) -> tuple[Comm, Shards, int]:
    """Rank 1 joins rank 0's replica group of two: the state copied (``_transfer``), then
    the shards exchanged (``_exchange_shards``); the epoch's comm, the group and what this
    rank holds."""
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, proc == 0, T)
    comm = Comm(store, "e/", proc, 2, T, lambda: False)
    group = comm.subgroup(store, "shard0", proc, 2)
    shards = Shards(
        optimizer_params(tr.optimizer), k=2, rank=proc, group=group, timeout=T, module=tr.module
    )
    tr.shards = shards
    held = _copied_to_rank_1(tr, comm, proc)
    tr.keep_shard(*shards.exchange(comm, held, tr.whole_optimizer(), tr.filled))
    return comm, shards, held


def _joined(proc: int, port: int, dataset: str, q: mp.Queue) -> None:
    """Rank 0 holds every shard from the seed, virtually; rank 1 joins (it receives the
    run's state, then its shard), as the worker does it: ``_transfer``, then
    ``_exchange_shards``."""
    config = _cfg(Path(dataset), 2, 2)
    tr = Trainer(config)
    comm, shards, held = _joined_as_the_worker_does(tr, port, proc)
    # bytes, not tensors: a tensor would travel as a handle to this process's memory
    params = {
        n: p.detach().numpy().tobytes() for n, p in tr.module.named_parameters() if resident(p)
    }
    q.put((proc, held, params, tr.peak_param_bytes, shards.received is not None))
    shards.close()
    comm.close()
    tr.close()


def test_a_joiner_receives_its_shard_from_a_replica_that_holds_it_only_from_the_seed(
    small_dataset: Path,
) -> None:
    """The joiner learns from the state it receives that its source holds nothing real
    (``held`` NONE), so it takes its shard in the exchange; the source makes that shard
    from the seed for the send and keeps only its own: each rank ends with its shard's
    parameters bit for bit those of the whole model initialised per module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_joined, args=(r, port, str(small_dataset), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r[1:] for r in (q.get(timeout=90) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    reference = Trainer(_cfg(small_dataset, 1, 1))  # per module, every parameter made
    try:
        want = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
    finally:
        reference.close()
    (held0, params0, peak0, recv0), (held1, params1, peak1, recv1) = got[0], got[1]
    assert (held0, held1) == (ALL, NONE) and (recv0, recv1) == (False, True)
    assert params0 and params1 and not set(params0) & set(params1)
    assert set(params0) | set(params1) == set(want)
    for name, b in {**params0, **params1}.items():
        assert b == want[name].numpy().tobytes(), name
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert max(peak0, peak1) < total  # neither held the whole model, the sender included


def _joined_from_checkpoint(proc: int, port: int, dataset: str, ckpt: str, q: mp.Queue) -> None:
    """Rank 0 loaded a checkpoint sharded at rest (every tensor still unread); rank 1
    joins, as in ``_joined``: rank 0 reads shard 1's parameters and AdamW state by range
    for the send, and its own shard's for itself."""
    config = _cfg(Path(dataset), 2, 2)
    tr = Trainer(config)
    if proc == 0:
        tr.load(ckpt)
    comm, shards, held = _joined_as_the_worker_does(tr, port, proc)
    params = {
        n: p.detach().numpy().tobytes() for n, p in tr.module.named_parameters() if resident(p)
    }
    state = {
        int(i): {k: v.numpy().tobytes() for k, v in s.items()}
        for i, s in tr.optimizer.state_dict()["state"].items()
    }
    q.put((proc, held, params, state, tr.next_step))
    shards.close()
    comm.close()
    tr.close()


def test_a_joiner_receives_its_shard_from_a_replica_that_loaded_it_by_range(
    small_dataset: Path, tmp_path: Path
) -> None:
    """A replica that loaded a checkpoint at rest sends a joiner the shard it does not
    keep, read by range from the files for the send: each rank ends with its shard's
    parameters and AdamW state bit for bit the checkpoint's."""
    from perdure.checkpoint import load_checkpoint, save_checkpoint

    whole = Trainer(_cfg(small_dataset, 1, 1))
    try:
        for step in range(2):
            bufs = [whole.layout.new_buffer() for _ in range(whole.config.train.slots)]
            assert whole.compute_slots(step, range(whole.config.train.slots), bufs)
            whole.apply(step, sum(bufs[1:], bufs[0].clone()))
        ckpt = str(save_checkpoint(tmp_path, whole.checkpoint_state({})))
        names = {id(p): n for n, p in whole.module.named_parameters()}
        order = [names[id(p)] for g in whole.optimizer.param_groups for p in g["params"]]
    finally:
        whole.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    args = (port, str(small_dataset), ckpt, q)
    procs = [ctx.Process(target=_joined_from_checkpoint, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = {r[0]: r[1:] for r in (q.get(timeout=90) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    saved = load_checkpoint(ckpt)
    (held0, params0, state0, step0), (held1, params1, state1, step1) = got[0], got[1]
    assert (held0, held1, step0, step1) == (ALL, NONE, 2, 2)
    assert params0 and params1 and not set(params0) & set(params1)
    assert set(params0) | set(params1) == set(saved.model)
    for name, b in {**params0, **params1}.items():
        assert b == saved.model[name].numpy().tobytes(), name
    assert state0 and state1 and not set(state0) & set(state1)
    assert set(state0) | set(state1) == set(saved.optimizer["state"])
    for i, s in {**state0, **state1}.items():
        want = {k: v.numpy().tobytes() for k, v in saved.optimizer["state"][i].items()}
        assert s == want, order[i]
    # each rank keeps the optimizer state of the parameters it keeps
    assert {order[i] for i in state0} == set(params0)


@pytest.mark.parametrize("at_rest", [False, True], ids=["whole", "holder_by_holder"])
def test_a_module_nothing_can_initialise_is_refused_before_any_worker_starts(
    small_dataset: Path, tmp_path: Path, at_rest: bool
) -> None:
    """Preflight initialises as the workers do: the whole model, or sharded at rest one
    holder module at a time (the launcher never holds the model)."""
    (tmp_path / "bare_init_task.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from examples.tiny_lm.task import make_task as tiny\n"
        "class Scale(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.gain = nn.Parameter(torch.ones(4))\n"
        "def make_task(**options):\n"
        "    task = tiny(**options)\n"
        "    task.model.extra = Scale()\n"
        "    return task\n"
    )
    cfg = small_config(
        small_dataset,
        task={"entry": "bare_init_task:make_task", "init": "per_module"},
        train={"shard_degree": 2, "shard_params": at_rest},
        run={"base_dir": str(tmp_path)},
    )
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    [problem] = info.value.problems
    assert problem.key == "task.init" and problem.value == "per_module"
    assert "'extra' (Scale)" in problem.rule and "reset_parameters" in problem.rule


def test_preflight_of_a_model_sharded_at_rest_says_its_loss_was_not_measured(
    small_dataset: Path,
) -> None:
    at_rest = preflight(_cfg(small_dataset, 2, 2))
    assert any("not measured" in n and "task.loss_reduction" in n for n in at_rest.notes)
    whole = preflight(_cfg(small_dataset, 2, 2, train={"shard_params": False}))
    assert not any("not measured" in n for n in whole.notes)


def test_the_eager_default_keeps_the_config_hash_of_runs_before_task_init_existed() -> None:
    """``task.init`` at its default (the math every earlier run did) is left out of the
    canonical config, so checkpoints written before the field existed keep their hash;
    ``per_module`` enters it."""
    from perdure.run_config import canonical, config_hash, with_overrides

    eager = RunConfig()
    per_module = with_overrides(eager, task={"init": "per_module"})
    assert "init" not in canonical(eager)["task"]
    assert canonical(per_module)["task"]["init"] == "per_module"
    assert config_hash(per_module) != config_hash(eager)
