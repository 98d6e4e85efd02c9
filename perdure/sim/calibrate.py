"""The simulator's measured inputs, read from the benchmark result files.

Every cost the policies pay for a fault, and every rate the step and checkpoint models
use, is read here from ``benchmarks/results/*.json`` (written by ``benchmarks/bench_*.py``)
rather than typed into the code; a missing file or key raises :class:`CalibrationError`
naming both. Each derived number says how it is derived, and from which fields:

- ``recovery.json`` (3 replicas on this 2-core machine, a kill right after a commit):
  perdure's epoch formation (kill -> ``epoch_started``), the replacement's start-up
  (kill -> its ``join``, minus the launcher's ``replace_after_ms``), the members' stall when
  it is planned in (the commit gap around the join epoch, minus a step); torchrun's restart
  (recovery minus the steps redone since the checkpoint, which the run's ``fault_step``
  and ``ckpt_every`` fix); torchft's quorum (recovery minus one step). Medians over runs.
- ``reduce.json``: the chain's time over ``all_reduce``'s (median over rows, default chunk).
- ``step.json``: perdure's whole-runtime step over DDP's, for slots = workers (the
  pre-streaming step's overhead on compute, CPU-bound).
- ``wire_streamed.json``, ``wire_streamed_w.json`` (``bench_wire.py`` on a 200 Mbit/s
  shaped link, W = 2): the streamed reduction's step over DDP's at the same
  micro-batching, and its bytes on the wire over DDP's; medians over the ``streamed32``
  rows at k = 1, a row of ``wire_streamed_w.json`` (the re-run after the margin went to 3
  bits) replacing ``wire_streamed.json``'s at the same micro-batching.
- ``checkpoint.json``: the snapshot's rate (what blocks the step loop), one rank's
  whole-state ``torch.save`` and ``torch.load`` (bytes / seconds, medians).
- ``reshard_load_100m.json`` (``bench_reshard_load.py``, 101.6M parameters): a sharded
  save's and load's rate per rank, the slowest rank's shard bytes over its seconds:
  perdure's save (each rank writes what it holds), DCP's save from FSDP2 and ``dcp.load``
  (the read alone, without the recipe's ``get_state_dict`` / ``set_state_dict``).
- ``state_copy.json`` (``bench_state_copy.py --netns``: holders on 100 Mbit/s links, the
  joiner on 300 Mbit/s): the swarm copy's rate per holder as a share of a holder's
  measured link (one holder), and its cap as a share of the joiner's measured link (the
  most holders); its fixed cost is :data:`SWARM_FIXED_S`.
- ``scaling.json``: state bytes per parameter; step time against worker count on this
  host (what a time-shared host does when a member is missing).

Limits: every number is a loopback measurement on 2 shared cores; the models that carry
them to a deployment add network terms (:mod:`perdure.sim.steptime`) but cannot know what
changes with real NICs and GPUs (see ``docs/simulation.md``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.runtime.config import ClusterConfig

REQUIRED = (
    "recovery",
    "state_copy",
    "reshard_load_100m",
    "reduce",
    "step",
    "checkpoint",
    "scaling",
    "wire_streamed",
    "wire_streamed_w",
)
"""The result files the calibration reads (``benchmarks/results/<name>.json``)."""


class CalibrationError(ValueError):
    """A calibration input is missing or unusable; the message names the file and key."""


SWARM_FIXED_S = 0.023
"""The swarm copy's fixed cost, s: three all-gathers (offers, plan, verdict) and two
messages per range, whatever the bytes. ``docs/performance.md`` section 17, the run at
``bench_state_copy.py --mb 2`` (one holder: 23 ms; two: 26 ms); that run's numbers are in
the doc, not in ``state_copy.json`` (which holds the 384 MiB and 24 MiB runs, whose
fixed part is below their noise)."""


@dataclass(frozen=True)
class CopyRate:
    """How long a state copy to one joiner takes: ``fixed_s + bytes / min(per_holder x
    the holders' links summed, cap x the joiner's link)`` (every GPU of a replica copies
    its own share on its own links at once, so this is per GPU)."""

    per_holder: float
    """What one holder sends at, as a share of its link to the joiner."""
    cap: float
    """What the joiner receives at most, as a share of its own link."""
    fixed_s: float
    """The copy's fixed cost (messages and agreement, not bytes)."""

    def seconds(self, nbytes: float, holder_bps: tuple[float, ...], joiner_bps: float) -> float:
        """``nbytes`` from holders with these links (bytes/s each) to a joiner whose link
        is ``joiner_bps``."""
        if not holder_bps:
            raise ValueError("a state copy needs at least one holder")
        rate = min(self.per_holder * sum(holder_bps), self.cap * joiner_bps)
        return self.fixed_s + nbytes / rate


@dataclass(frozen=True)
class GoodputRun:
    """One goodput row of ``recovery.json``: the measured workload and its result."""

    name: str
    goodput: tuple[float, float, float]
    """min / median / max of the per-pair clean span / faulty span."""
    clean_span_s: float
    faulty_span_s: float
    steps: int
    kill_steps: tuple[int, ...]
    ckpt_every: int | None

    @property
    def step_s(self) -> float:
        """The fault-free step time: the clean span over the steps it covers."""
        return self.clean_span_s / (self.steps - 1)


@dataclass(frozen=True)
class Calibration:
    """Measured costs and rates (see the module docstring for each derivation)."""

    source: str
    """The results directory these came from."""
    perdure_reconfigure_s: float
    """Kill -> the survivors' new membership epoch started (detection by socket close,
    announce, ready, start, process group): ``new_epoch_s``."""
    perdure_replacement_start_s: float
    """A replacement's start-up beyond the launcher's delay (fork from the zygote,
    admission): ``replacement_join_s`` - ``replace_after_ms``."""
    perdure_join_stall_s: float
    """Extra time of the step at which a joiner is planned in: ``join_commit_gap_s`` -
    ``step_s_before`` (an epoch formation plus the state copy)."""
    recovery_state_bytes: float
    """State bytes of the recovery workload's model (``params_approx`` x bytes/param)."""
    perdure_recovery_s: float
    perdure_step_s: float
    torchrun_restart_s: float
    """Every process restarted: agent, rendezvous, Python + torch, checkpoint load:
    ``recovery_s`` - (steps since the checkpoint + 1) x ``step_s_before``."""
    torchrun_ckpt_bytes: float
    """What that restart loaded (the recovery workload's state)."""
    torchrun_recovery_s: float
    torchrun_step_s: float
    torchft_quorum_s: float
    """The survivors' step abort and new quorum: ``recovery_s`` - ``step_s_before``."""
    torchft_recovery_s: float
    torchft_step_s: float
    chain_over_ring: float
    """Chain reduction time over ring ``all_reduce`` at the same payload."""
    perdure_step_overhead: float
    """perdure's whole-runtime step over DDP's, slots = workers (pre-streaming, CPU-bound)."""
    streamed_overhead: float
    """The streamed reduction's step over DDP's at the same micro-batching, wire-bound."""
    streamed_bytes: float
    """The streamed reduction's bytes on the wire per step over DDP's."""
    snapshot_gbps: float
    """Checkpoint snapshot (what blocks the step loop), Gbit/s."""
    torch_save_gbps: float
    """One rank's whole-state ``torch.save`` + fsync, Gbit/s (checkpoint.json)."""
    torch_load_gbps: float
    """``torch.load(weights_only=True)``, Gbit/s (what a restarted DDP job reads)."""
    sharded_save_gbps: float
    """perdure's save, every rank writing its shard (+ fsync), Gbit/s a rank
    (reshard_load_100m.json ``save_perdure``)."""
    dcp_save_gbps: float
    """DCP's save from FSDP2, every rank its shard (+ fsync), Gbit/s a rank
    (``save_dcp``): a peer's save when the checkpoint is sharded over every GPU."""
    dcp_load_gbps: float
    """``dcp.load`` of a rank's shard, Gbit/s a rank (``dcp[].dcp_load_seconds``): a
    peer's restart load when the checkpoint is sharded over every GPU."""
    swarm: CopyRate
    """The swarm state copy (``runtime/comm/swarm.py``), from state_copy.json."""
    state_bytes_per_param: float
    """Model + optimizer bytes per parameter in a checkpoint."""
    host_curve: tuple[tuple[int, float], ...]
    """(workers, step s) of one fixed workload on this host."""
    goodput_runs: tuple[GoodputRun, ...]
    """The measured goodput workloads (validation targets)."""
    goodput_model_params: float
    """Parameters of the goodput workload's model (``step.json``'s ``small`` model: the
    same d_model 64, 2 layers)."""

    @property
    def broadcast_copy_gbps(self) -> float:
        """The state-copy rate of the recovery benchmark's runs (one source, the old
        broadcast path, ``comm/transfer.py``, before the swarm copy): the join stall
        beyond an epoch formation, over the state bytes. Only the validation, which
        replays those runs, uses it."""
        extra = self.perdure_join_stall_s - self.perdure_reconfigure_s
        if extra <= 0:
            raise CalibrationError(
                f"{self.source}/recovery.json: the join stall ({self.perdure_join_stall_s:.3f}"
                f" s) is not above an epoch formation ({self.perdure_reconfigure_s:.3f} s): "
                "no state-copy rate can be derived"
            )
        return self.recovery_state_bytes * 8 / extra / 1e9


class _File:
    """One result file, with lookups that name the file and key when they fail."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = directory / f"{name}.json"
        try:
            self.data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise CalibrationError(
                f"calibration input missing: {self.path} (run benchmarks/bench_{name}.py)"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise CalibrationError(f"calibration input unreadable: {self.path}: {e}") from None

    def get(self, *keys: str | int, base: Any = None) -> Any:
        node = self.data if base is None else base
        for k in keys:
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                where = ".".join(str(x) for x in keys)
                raise CalibrationError(f"{self.path}: missing {where}") from None
        return node

    def num(self, *keys: str | int, base: Any = None) -> float:
        v = self.get(*keys, base=base)
        if not isinstance(v, int | float) or isinstance(v, bool):
            where = ".".join(str(x) for x in keys)
            raise CalibrationError(f"{self.path}: {where} is not a number (got {v!r})")
        return float(v)

    def median_of(self, rows: list[Any], *keys: str) -> float:
        vals = [self.num(*keys, base=r) for r in rows]
        if not vals:
            raise CalibrationError(f"{self.path}: no rows for {'.'.join(keys)}")
        return statistics.median(vals)


def load_calibration(results_dir: str | Path) -> Calibration:
    """Read and derive every calibration input from ``results_dir``."""
    d = Path(results_dir)
    rec, red, step = _File(d, "recovery"), _File(d, "reduce"), _File(d, "step")
    ck, sc = _File(d, "checkpoint"), _File(d, "scaling")
    bpp = _bytes_per_param(sc)
    return Calibration(
        source=str(d),
        **_perdure_costs(rec, bpp),
        **_peer_costs(rec, bpp),
        chain_over_ring=red.num("summary", "ratio_default_chunk", "median"),
        perdure_step_overhead=_step_overhead(step),
        **_streamed(_File(d, "wire_streamed"), _File(d, "wire_streamed_w")),
        **_checkpoint_rates(ck),
        **_sharded_rates(_File(d, "reshard_load_100m")),
        swarm=_swarm(_File(d, "state_copy")),
        state_bytes_per_param=bpp,
        host_curve=_host_curve(sc),
        goodput_runs=_goodput_runs(rec),
        goodput_model_params=_small_params(step),
    )


def _perdure_costs(rec: _File, bpp: float) -> dict[str, float]:
    runs = [r for r in rec.get("recovery", "perdure", "runs") if not r.get("error")]
    step_s = rec.median_of(runs, "step_s_before")
    # the benchmark runs with perdure's default launcher delay (its config sets none)
    replace_after_s = ClusterConfig().replace_after_ms / 1000
    return {
        "perdure_reconfigure_s": rec.median_of(runs, "new_epoch_s"),
        "perdure_replacement_start_s": rec.median_of(runs, "replacement_join_s") - replace_after_s,
        "perdure_join_stall_s": rec.median_of(runs, "join_commit_gap_s") - step_s,
        "recovery_state_bytes": rec.num("workload", "params_approx") * bpp,
        "perdure_recovery_s": rec.median_of(runs, "recovery_s"),
        "perdure_step_s": step_s,
    }


def _peer_costs(rec: _File, bpp: float) -> dict[str, float]:
    tr = [r for r in rec.get("recovery", "torchrun", "runs") if not r.get("error")]
    restarts = []
    for r in tr:
        fault, every = int(rec.num("fault_step", base=r)), int(rec.num("ckpt_every", base=r))
        ckpt = (fault + 1) // every * every  # the peer saves after step s when (s+1) % every == 0
        steps_after_restart = fault + 2 - ckpt  # redo ckpt..fault, then the first new step
        restarts.append(
            rec.num("recovery_s", base=r) - steps_after_restart * rec.num("step_s_before", base=r)
        )
    ft = [r for r in rec.get("recovery", "torchft", "runs") if not r.get("error")]
    quorum = [rec.num("recovery_s", base=r) - rec.num("step_s_before", base=r) for r in ft]
    if not restarts or not quorum:
        raise CalibrationError(f"{rec.path}: no torchrun or torchft recovery runs")
    return {
        "torchrun_restart_s": statistics.median(restarts),
        "torchrun_ckpt_bytes": rec.num("workload", "params_approx") * bpp,
        "torchrun_recovery_s": rec.median_of(tr, "recovery_s"),
        "torchrun_step_s": rec.median_of(tr, "step_s_before"),
        "torchft_quorum_s": statistics.median(quorum),
        "torchft_recovery_s": rec.median_of(ft, "recovery_s"),
        "torchft_step_s": rec.median_of(ft, "step_s_before"),
    }


def _step_overhead(step: _File) -> float:
    rows = [r for r in step.get("rows") if r.get("slots") == r.get("workers")]
    return step.median_of(rows, "ratio_runtime_over_ddp_median")


STREAMED_CONFIG = "streamed32"
"""The ``bench_wire.py --perdure`` row name of the streamed 32-bit reduction."""


def _streamed(old: _File, new: _File) -> dict[str, float]:
    rows: dict[int, tuple[_File, Any]] = {}
    for f in (old, new):  # the newer file's row replaces the older's at a micro-batching
        for r in f.get("rows"):
            if r.get("config") == STREAMED_CONFIG and r.get("k") == 1:
                rows[int(f.num("micro", base=r))] = (f, r)
    if not rows:
        raise CalibrationError(
            f"{old.path}, {new.path}: no {STREAMED_CONFIG!r} row at k = 1 (run "
            f"benchmarks/bench_wire.py --perdure '{STREAMED_CONFIG}:...')"
        )
    return {
        "streamed_overhead": statistics.median(f.num("vs_ddp", base=r) for f, r in rows.values()),
        "streamed_bytes": statistics.median(
            f.num("bytes_vs_ddp", base=r) for f, r in rows.values()
        ),
    }


def _small_params(step: _File) -> float:
    rows = [r for r in step.get("rows") if r.get("model") == "small"]
    return step.median_of(rows, "params")


def _checkpoint_rates(ck: _File) -> dict[str, float]:
    nbytes = ck.num("state_bytes")

    def gbps(*keys: str) -> float:
        return nbytes * 8 / ck.num(*keys) / 1e9

    return {
        "snapshot_gbps": gbps("snapshot", "sync_copy", "blocking_s", "median"),
        "torch_save_gbps": gbps("write_load", "torch_save_fsync_s", "median"),
        "torch_load_gbps": gbps("write_load", "torch_load_weights_only_s", "median"),
    }


def _sharded_rates(rs: _File) -> dict[str, float]:
    """Per-rank rates of a sharded save and load: the slowest rank's shard bytes over
    its seconds (every rank works at once; a step waits for the last)."""

    def slowest(section: str, seconds: str = "seconds") -> float:
        ranks = rs.get(section, "ranks")
        if not ranks:
            raise CalibrationError(f"{rs.path}: no {section}.ranks")
        r = max(ranks, key=lambda r: rs.num(seconds, base=r))
        return rs.num("shard_bytes", base=r) * 8 / rs.num(seconds, base=r) / 1e9

    return {
        "sharded_save_gbps": slowest("save_perdure"),
        "dcp_save_gbps": slowest("save_dcp"),
        "dcp_load_gbps": slowest("dcp", "dcp_load_seconds"),
    }


SWARM_ARM = "swarm"
"""The ``bench_state_copy.py`` arm of the swarm copy."""


def _swarm(sc: _File) -> CopyRate:
    """The shaped-link rows (``netns``): each holder's path is shaped to ``holder_mbit``,
    the joiner's to ``joiner_mbit``; a plain socket copy over one holder's path measured
    ``raw_tcp_mbit_0_to_3``, so a link delivers raw / shaped of its nominal rate. Per
    holder: the one-holder row over the measured link. Cap: the row with the most holders
    over the joiner's measured link (there the holders' links sum to the joiner's)."""
    net = sc.get("netns")
    raw = sc.num("raw_tcp_mbit_0_to_3", base=net)
    holder_link = raw
    joiner_link = sc.num("joiner_mbit", base=net) * raw / sc.num("holder_mbit", base=net)
    rows = {
        int(sc.num("holders", base=r)): r
        for r in sc.get("rows", base=net)
        if r.get("arm") == SWARM_ARM
    }
    if 1 not in rows:
        raise CalibrationError(f"{sc.path}: no netns row of arm {SWARM_ARM!r} with 1 holder")
    most = rows[max(rows)]
    if max(rows) * holder_link < joiner_link * 0.999:
        raise CalibrationError(
            f"{sc.path}: the netns rows never fill the joiner's link "
            f"({max(rows)} x {holder_link} < {joiner_link} Mbit/s): no cap can be derived"
        )
    return CopyRate(
        per_holder=sc.num("gbit_s", base=rows[1]) * 1000 / holder_link,
        cap=sc.num("gbit_s", base=most) * 1000 / joiner_link,
        fixed_s=SWARM_FIXED_S,
    )


def _bytes_per_param(sc: _File) -> float:
    rows = sc.get("series", "model")
    return statistics.median(
        sc.num("checkpoint_bytes", base=r) / sc.num("params", base=r) for r in rows
    )


def _host_curve(sc: _File) -> tuple[tuple[int, float], ...]:
    rows = [r for r in sc.get("series", "workers") if r.get("rc", 0) == 0]
    curve = tuple((int(sc.num("workers", base=r)), sc.num("step_s", base=r)) for r in rows)
    if len(curve) < 2:
        raise CalibrationError(f"{sc.path}: series.workers needs >= 2 rows")
    return curve


def _goodput_runs(rec: _File) -> tuple[GoodputRun, ...]:
    rows = rec.get("goodput")
    steps = int(rec.num("workload", "goodput_steps"))
    out = []
    for name, row in rows.items():
        g = row.get("goodput") or {}
        out.append(
            GoodputRun(
                name=name,
                goodput=(rec.num("min", base=g), rec.num("median", base=g), rec.num("max", base=g)),
                clean_span_s=rec.num("clean_span_s", "median", base=row),
                faulty_span_s=rec.num("faulty_span_s", "median", base=row),
                steps=steps,
                kill_steps=tuple(int(s) for s in rec.get("kill_steps", base=row)),
                ckpt_every=(row.get("runs") or [{}])[0].get("ckpt_every"),
            )
        )
    if not out:
        raise CalibrationError(f"{rec.path}: no goodput rows")
    return tuple(out)
