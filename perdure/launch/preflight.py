"""Preflight: the errors every worker would hit the same way, found before any starts.

A config can be valid field by field and still fail in every worker at start-up: a task
entry that does not import, a dataset that is not there, a model whose vocabulary or
length is smaller than the dataset's, a batch larger than the dataset, a poisoned (or
corrupted) part past the last one, a resume checkpoint written under another config.
Started anyway, each worker crashes, each replacement crashes the same way, and the cause
is in a worker log. Preflight does in the launcher, once, what a worker does first: it
imports and builds the task (seeded as a worker would), opens the dataset (the manifest
and a listing, no part bytes), reads the resume checkpoint's context (tensors mapped, not read or
verified: the workers verify every checksum), and checks each against the others. Every
problem names the field or flag, the rule and the value, all reported at once.

Limits: the model is built once on the CPU, so preflight holds one replica's initial
weights for a moment (a model too large for the launcher's memory needs the workers'
machine); a task that declares neither ``Task.vocab_size`` nor ``Task.max_len`` gets
neither check; the batch is never run, so an error inside the model's forward is still
the workers' to report (the launcher stops a run whose workers fail the same way twice
at start-up, see ``launch/local.py``). Fields are checked only as far as the task
declares them (``Task.fields``): a ``loss_fn`` that reads an undeclared field the dataset
lacks fails in the workers (a ``KeyError`` naming it).
"""

from __future__ import annotations

import dataclasses
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perdure.chaos.faults.corrupt_part import CORRUPT_PART
from perdure.chaos.faults.poison_part import POISON_PART
from perdure.config.errors import ConfigError, Problem
from perdure.data.config import DataConfig
from perdure.metrics.config import missing_libraries
from perdure.run_config import RunConfig, canonical, config_hash, dataset_path

if TYPE_CHECKING:
    from perdure.checkpoint import LoadedCheckpoint
    from perdure.data import Dataset
    from perdure.runtime.replica.task import Task

DEFAULT_DATASET = DataConfig().dataset
"""The path the shipped configs name (``data.dataset``'s default): ``perdure run`` builds
the stdlib dataset there when it is missing."""

STDLIB_MAX_MB = 10.0
"""Source bytes of the stdlib dataset (the same recipe as ``benchmarks/_common.py``)."""

MAX_MS = 10**12
"""Upper bound of every ``*_ms`` duration (about 31 years): Python's timers overflow
at ``threading.TIMEOUT_MAX`` seconds, not far above."""

MAX_SEED = 2**64
"""``torch.manual_seed`` takes seeds below this."""

MAX_POSITION = 2**63
"""Sample positions (``steps x global_batch``) are int64."""


class PreflightError(ConfigError):
    """Every preflight problem of one run, reported at once (each: field or flag, rule,
    value). A :class:`ConfigError`, so that whoever reports config problems reports these."""

    def __str__(self) -> str:
        where = f"preflight of {self.source}" if self.source else "preflight"
        if len(self.problems) == 1:
            return f"{where}: {self.problems[0]}"
        return "\n".join([f"{where}: {len(self.problems)} problems"] +
                         [f"  - {p}" for p in self.problems])  # fmt: skip


@dataclass
class Report:
    """What preflight found besides problems, and how long it took."""

    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """One line each: a dataset built, a dataset that ``perdure run`` will build, a config
    change allowed at resume."""
    override: dict[str, Any] | None = None
    """The decision-log entry of a config change allowed at resume (the workers record the
    same entry; the launcher logs it as the run's ``decision`` event)."""
    identity: dict[str, Any] | None = None
    """The run's identity (dataset version, recipe): with the config, the run's hash."""


def preflight(
    config: RunConfig,
    *,
    source: str | None = None,
    resume: str | None = None,
    allow_config_change: bool = False,
    build_default: bool = False,
    say: Callable[[str], None] | None = None,
    launcher: str = "local",
) -> Report:
    """Check ``config`` (and the resume checkpoint) as the workers would meet it; raise
    :class:`PreflightError` listing every problem. ``build_default``: build the stdlib
    dataset when ``data.dataset`` is the shipped default path and nothing is there (what
    ``perdure run`` does); ``say`` hears about it before the build starts. ``launcher``:
    where the workers run; with ``ray`` they run on the cluster's nodes, so CUDA is not
    asked of this host (the Ray launcher checks the GPUs its workers reserve)."""
    t0 = time.perf_counter()
    report = Report()
    report.notes += missing_libraries(config.metrics)
    report.notes += _exact_kernels(config)
    problems = _bounds(config, here=launcher == "local")
    task = _task(config, problems) if config.train.seed < MAX_SEED else None
    dataset = _dataset(config, problems, report, build_default, say)
    if dataset is not None:
        problems += _fit(config, task, dataset)
    identity = report.identity = _recipe(config, task, dataset, problems, report)
    problems += _eval(config, task)
    if resume is not None:
        args = (task, dataset, allow_config_change, report, identity)
        problems += _resume(config, resume, *args)
    if dataset is not None:
        dataset.close()
    report.seconds = round(time.perf_counter() - t0, 3)
    if problems:
        raise PreflightError(problems, source)
    return report


def _exact_kernels(config: RunConfig) -> list[str]:
    """Build the exact reduction's fused kernels here, once, so that no worker on this
    machine pays the build (about a second) inside its timeouts: a worker loads the cached
    library. A worker on another machine builds its own, under the same lock. A note when
    they are off or cannot be built: the workers use the torch ops, same bits, slower."""
    if config.train.reduction != "exact":
        return []
    from perdure.runtime.comm.exact import fused_kernels

    if fused_kernels() is not None:
        return []
    return [
        "train.reduction: the exact reduction's fused kernels are off or cannot be built "
        "here (the log says why); the workers use the torch ops: the same bits, slower"
    ]


# -- numbers that pass their field's rule and still cannot run ----------------------------


def _bounds(config: RunConfig, here: bool = True) -> list[Problem]:
    """Values no worker could run with; ``here``: the workers run on this host."""
    out = []
    for section in ("cluster", "checkpoint", "chaos"):
        value = getattr(config, section)
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.name.endswith("_ms") and isinstance(v, int | float) and abs(v) > MAX_MS:
                out.append(Problem(f"{section}.{f.name}", f"must be at most {MAX_MS} ms", v))
    t = config.train
    if t.device == "cuda" and here:
        from perdure.runtime.replica.placement import cuda_problem

        problem = cuda_problem()
        if problem is not None:
            out.append(Problem("train.device", problem, t.device))
    if t.seed >= MAX_SEED:
        out.append(Problem("train.seed", f"must be < 2**64 ({MAX_SEED})", t.seed))
    if t.steps * t.global_batch >= MAX_POSITION:
        rule = "train.steps x train.global_batch must be < 2**63 (int64 sample positions)"
        out.append(Problem("train.global_batch", rule, t.global_batch))
    return out


# -- the task ------------------------------------------------------------------------------


def _task(config: RunConfig, problems: list[Problem]) -> Task | None:
    """Build the task once, as a worker does (seeded); its construction error as a problem."""
    from perdure.runtime.replica.task import build_task

    entry = config.task.entry
    try:
        task = build_task(config.task, config.train.seed, config.run.base_dir)
    except ValueError as e:
        text = str(e)
        if text.startswith("task.entry: "):  # resolve()'s and build_task()'s own errors
            problems.append(Problem("task.entry", text.removeprefix("task.entry: "), entry))
            return None
        problems.append(_factory_problem(config, e))
    except Exception as e:  # the user's factory: any error is the config's problem
        problems.append(_factory_problem(config, e))
        return None
    return task if _initialised(config, task, problems) else None


def _initialised(config: RunConfig, task: Task, problems: list[Problem]) -> bool:
    """With ``task.init = "per_module"``: every module initialised as a worker would, so
    a module that nothing can initialise is refused now. The whole model at once, or with
    ``train.shard_params`` one holder module at a time, freed again (a model sharded at
    rest need not fit the launcher: its loss is then not measured, see ``_recipe``)."""
    if config.task.init != "per_module":
        return True
    try:
        _initialise(task, config.train.seed, whole=not config.train.shard_params)
    except Exception as e:  # the task's init or a module's reset_parameters
        problems.append(Problem("task.init", f"{type(e).__name__}: {e}", config.task.init))
        return False
    return True


def _initialise(task: Task, seed: int, *, whole: bool) -> None:
    from perdure.runtime.replica.deferred import SeedInit, at_rest, free

    at_rest(task.model)
    seeded = SeedInit(task.model, seed=seed, init=task.init)
    if whole:
        seeded.fill(list(task.model.parameters()))
        return
    for _, _, own in seeded.holders:
        seeded.fill(own)
        for p in own:
            free(p)


def _at_rest(config: RunConfig) -> bool:
    """Whether preflight holds the model at rest (initialised per module, sharded)."""
    return config.task.init == "per_module" and config.train.shard_params


def _factory_problem(config: RunConfig, e: Exception) -> Problem:
    rule = f"{config.task.entry} raised {type(e).__name__}: {e}"
    return Problem("task.options", rule, config.task.options)


def _recipe(
    config: RunConfig,
    task: Task | None,
    ds: Dataset | None,
    problems: list[Problem],
    report: Report,
) -> dict[str, Any] | None:
    """The task's recipe as a worker builds it, its loss contract checked on the first
    slot's samples; returns the run's identity (None when the task or dataset failed)."""
    from perdure.runtime.replica.buffers import BufferRule
    from perdure.runtime.replica.identity import check_loss_reduction, run_identity
    from perdure.runtime.replica.outer import check_outer
    from perdure.runtime.replica.recipe import Recipe, RecipeError

    if task is None or ds is None:
        return None
    try:
        recipe = Recipe(task, config.optim, config.train.steps)
        if config.outer.on:
            check_outer(BufferRule(task.model), recipe, config.outer.replicas)
    except RecipeError as e:
        problems.append(Problem(e.field, e.rule, e.value))
        return None
    except Exception as e:  # the user's optimizer or scheduler factory
        problems.append(_factory_problem(config, e))
        return None
    if problems:  # the data does not fit the task or the batch: no slot to measure on
        return run_identity(task, recipe.initial, ds.version_id)
    if _at_rest(config):
        report.notes.append(
            f"task.loss_reduction: {task.loss_reduction!r} not measured: with task.init = "
            "'per_module' and train.shard_params the launcher does not make the whole model"
        )
        return run_identity(task, recipe.initial, ds.version_id)
    from perdure.runtime.replica.task import LossFnError

    try:
        note = check_loss_reduction(task, _first_slot(config, ds))
    except LossFnError as e:  # its result's shape (Task.metrics), not its reduction
        problems.append(Problem("task.entry", str(e), config.task.entry))
        note = None
    except ValueError as e:
        problems.append(
            Problem("task.loss_reduction", str(e).partition(": ")[2], task.loss_reduction)
        )
        note = None
    except Exception as e:  # the user's loss_fn on real samples
        problems.append(
            Problem("task.entry", f"loss_fn raised {type(e).__name__}: {e}", config.task.entry)
        )
        note = None
    if note:
        report.notes.append(note)
    return run_identity(task, recipe.initial, ds.version_id)


def _first_slot(config: RunConfig, ds: Dataset) -> dict[str, Any]:
    from perdure.data import SlotLoader
    from perdure.runtime.replica.slots import to_tensors

    train = config.train
    loader = SlotLoader(
        ds,
        seed=train.seed,
        global_batch=train.global_batch,
        slots=train.slots,
        prefetch_steps=0,
        document_fields=config.data.document_fields and _has_documents(ds),
    )
    try:
        return to_tensors(loader.batch(0, 0))
    finally:
        loader.close()


# -- the dataset ---------------------------------------------------------------------------


def _dataset(
    config: RunConfig,
    problems: list[Problem],
    report: Report,
    build_default: bool,
    say: Callable[[str], None] | None,
) -> Dataset | None:
    from perdure.data import DataError, Dataset

    url = dataset_path(config)
    if _missing(url):
        demo = _is_demo(url)
        if config.data.dataset != DEFAULT_DATASET and not demo:
            problems.append(Problem("data.dataset", _how_to_build(url), url))
            return None
        how = "`perdure demo`" if demo else stdlib_build_command(url)
        if not build_default:
            report.notes.append(
                f"data.dataset: {url} is not built yet; `perdure run` builds it, or now: {how}"
            )
            return None
        if say is not None:
            say(f"building the stdlib dataset at {url} (once): {how}")
        try:
            build_demo_dataset(url) if demo else build_stdlib_dataset(url)
        except (DataError, OSError) as e:
            problems.append(Problem("data.dataset", f"could not be built: {e}", url))
            return None
        report.notes.append(f"data.dataset: built {url} from the standard library's sources")
    try:
        return Dataset.open(url, cache_mb=config.data.cache_mb)
    except DataError as e:
        problems.append(Problem("data.dataset", f"cannot be opened: {e}", url))
        return None


def _eval(config: RunConfig, task: Task | None) -> list[Problem]:
    """The held-out data set (``[eval]``) opens, and the task's evaluation runs on two of
    its samples, so that a bad path or a broken ``eval_fn`` stops the run now, not at its
    first evaluation."""
    from perdure.data import DataError, Dataset
    from perdure.run_config import resolve_path
    from perdure.runtime.member.evaluate import Evaluator

    cfg = config.eval
    if not cfg.every_steps:
        return []
    url = resolve_path(config, cfg.dataset or "")
    if _missing(url):
        return [Problem("eval.dataset", _how_to_build(url), url)]
    try:
        ds = Dataset.open(url, cache_mb=config.data.cache_mb)
    except DataError as e:
        return [Problem("eval.dataset", f"cannot be opened: {e}", url)]
    if task is None:
        ds.close()
        return []
    probe = dataclasses.replace(cfg, samples=2, batch_size=2)
    ev = Evaluator(task, probe, ds, seed=config.train.seed, precision=config.train.precision)
    try:
        ev.run(0)
    except Exception as e:  # the user's eval_fn (or loss_fn) on held-out samples
        fn = "eval_fn" if task.eval_fn is not None else "loss_fn"
        return [Problem("eval.dataset", f"task.{fn} raised {type(e).__name__}: {e}", url)]
    finally:
        ev.close()
    return []


def _is_demo(url: str) -> bool:
    """Whether ``url`` is the demo's dataset (``runs/datasets/demo-stdlib`` under the
    config's base directory), which a run builds like the default one."""
    from perdure.launch.demo_data import DATASET as DEMO_DATASET

    return "://" not in url and Path(url).as_posix().endswith("/" + DEMO_DATASET.as_posix())


def build_demo_dataset(out: str) -> None:
    """The demo's corpus (``launch.demo_data.ensure_dataset``'s recipe)."""
    from rich.console import Console

    from perdure.launch.demo_data import ensure_dataset

    ensure_dataset(Path(out), Console(quiet=True))


def _how_to_build(url: str) -> str:
    """The commands that make each kind of dataset: text is built, arrays are imported."""
    return (
        f"no dataset there (no manifest.json); build one from text files with "
        f"`perdure data build SOURCES --out {url}`, or import token or other arrays "
        f"(.npy, nanoGPT's .bin) with `perdure data import FILES --out {url} "
        "[--field NAME=PATH]`"
    )


def _missing(url: str) -> bool:
    """A local path without a manifest (a remote URL is left to ``Dataset.open``)."""
    return "://" not in url and not (Path(url) / "manifest.json").exists()


def stdlib_build_command(out: str) -> str:
    src = sysconfig.get_paths()["stdlib"]
    return f"perdure data build {src} --include '*.py' --max-mb {STDLIB_MAX_MB:g} --out {out}"


def build_stdlib_dataset(out: str) -> None:
    """The stdlib dataset: this Python's own ``*.py`` sources, byte-level, 128-token
    samples (the recipe of :func:`stdlib_build_command`). It depends on the Python
    version, so two machines with different Pythons build different versions (the version
    id tells them apart)."""
    from perdure.data import build_dataset

    src = sysconfig.get_paths()["stdlib"]
    build_dataset([src], out, seq_len=128, include="*.py", max_mb=STDLIB_MAX_MB)


def _fit(config: RunConfig, task: Task | None, ds: Dataset) -> list[Problem]:
    """What the dataset must hold for this task and batch."""
    return (_model_fit(config, task, ds) if task is not None else []) + _sizes(config, ds)


def _model_fit(config: RunConfig, task: Task, ds: Dataset) -> list[Problem]:
    """The dataset's token ids and sample length against what the task declares."""
    out = []
    vocab = ds.manifest.build.get("vocab_size")
    if task.vocab_size is not None and isinstance(vocab, int) and task.vocab_size < vocab:
        rule = (
            f"the model's vocab_size {task.vocab_size} is smaller than the dataset's "
            f"{vocab} (token ids up to {vocab - 1}, {ds.url}/manifest.json build.vocab_size)"
        )
        out.append(Problem("task.options", rule, config.task.options))
    embedding = _first_embedding(task) if task.vocab_size is None else None
    if embedding is not None and isinstance(vocab, int) and embedding[1] < vocab:
        name, rows = embedding
        rule = (
            f"the dataset's vocabulary is {vocab} token ids ({ds.url}/manifest.json "
            f"build.vocab_size) but the model's embedding {name!r} has {rows} rows (ids up to "
            f"{rows - 1}); declare Task(vocab_size=...) to have this checked by name"
        )
        out.append(Problem("task.options", rule, config.task.options))
    if task.max_len is not None and ds.manifest.tokens and task.max_len < ds.seq_len:
        rule = (
            f"the model's max_len {task.max_len} is shorter than the dataset's seq_len "
            f"{ds.seq_len} (the model reads seq_len tokens a sample)"
        )
        out.append(Problem("task.options", rule, config.task.options))
    return out + _tokens_fit(task, ds) + _fields_fit(config, task, ds) + _documents_fit(config, ds)


def _tokens_fit(task: Task, ds: Dataset) -> list[Problem]:
    """A task that declares a vocabulary or a sample length reads tokens: a dataset without
    them (images and labels) is refused before a worker raises KeyError('tokens')."""
    declared = [k for k in ("vocab_size", "max_len") if getattr(task, k) is not None]
    if ds.manifest.tokens or not declared:
        return []
    rule = (
        f"the task declares {' and '.join(declared)} (it reads tokens) but the dataset has "
        f"no 'tokens' field, only {[f.name for f in ds.manifest.fields]} "
        f"({ds.url}/manifest.json)"
    )
    return [Problem("data.dataset", rule, ds.url)]


def _has_documents(ds: Dataset) -> bool:
    from perdure.data import DataError

    try:
        ds.documents()
    except DataError:
        return False
    return True


def _documents_fit(config: RunConfig, ds: Dataset) -> list[Problem]:
    """``data.document_fields`` needs a dataset that kept its document boundaries."""
    if not config.data.document_fields or _has_documents(ds):
        return []
    rule = (
        f"needs a dataset with document boundaries, and {ds.url} holds none (only Megatron "
        "and MDS imports record them: perdure data import --format megatron|mds)"
    )
    return [Problem("data.document_fields", rule, True)]


def _first_embedding(task: Task) -> tuple[str, int] | None:
    """The model's first ``nn.Embedding`` (name, rows): what reads token ids when the task
    does not declare ``vocab_size``."""
    from torch import nn

    for name, module in task.model.named_modules():
        if isinstance(module, nn.Embedding):
            return name, int(module.num_embeddings)
    return None


def _fields_fit(config: RunConfig, task: Task, ds: Dataset) -> list[Problem]:
    """The fields the task declares (``Task.fields``) against the manifest's."""
    from perdure.data.fields import FieldSpec

    if task.fields is None:
        return []
    have = {f.name: f for f in ds.manifest.fields}
    where = f"{ds.url}/manifest.json"
    out = []
    for name, spec in task.fields.items():
        if not isinstance(spec, FieldSpec):
            rule = f"Task.fields[{name!r}] must be a FieldSpec (got {type(spec).__name__})"
            out.append(Problem("task.entry", rule, config.task.entry))
        elif name not in have:
            rule = (
                f"the task needs field {name!r} (Task.fields); the dataset has "
                f"{sorted(have)} ({where})"
            )
            out.append(Problem("data.dataset", rule, ds.url))
        elif (why := spec.mismatch(have[name])) is not None:
            out.append(Problem("data.dataset", f"field {name!r} {why} ({where})", ds.url))
    return out


def _sizes(config: RunConfig, ds: Dataset) -> list[Problem]:
    """A step reads each sample at most once; a poisoned or corrupted part must exist."""
    out = []
    b = config.train.global_batch
    if b > ds.num_samples:
        rule = f"must be at most the dataset's {ds.num_samples} samples ({ds.url})"
        out.append(Problem("train.global_batch", rule, b))
    for i, f in enumerate(config.chaos.faults):
        if f.kind in (POISON_PART, CORRUPT_PART) and int(f.target) >= ds.num_parts:
            rule = f"must be a part of {ds.url}, in [0, {ds.num_parts})"
            out.append(Problem(f"chaos.faults[{i}].target", rule, f.target))
    return out


# -- the resume checkpoint -----------------------------------------------------------------


def _resume(
    config: RunConfig,
    path: str,
    task: Task | None,
    ds: Dataset | None,
    allow: bool,
    report: Report,
    identity: dict[str, Any] | None,
) -> list[Problem]:
    from perdure.checkpoint import CheckpointError, verify_checkpoint
    from perdure.checkpoint.ranges import open_lazy

    try:  # every file's CRC, streamed once here: a rank sharded at rest reads only ranges
        verify_checkpoint(path, checksums=config.checkpoint.verify_on_load)
        ckpt = open_lazy(path).loaded
    except (CheckpointError, OSError) as e:
        return [Problem("--resume", f"cannot be read: {e}", path)]
    out = _compatible(config, ckpt, allow, report, identity)
    version = ckpt.data.get("version_id") if isinstance(ckpt.data, dict) else None
    if ds is not None and version != ds.version_id:
        rule = f"made for dataset version {version}; data.dataset {ds.url} is {ds.version_id}"
        out.append(Problem("--resume", rule, path))
    if task is not None:
        out += _shapes(ckpt, task, path)
    return out


def _compatible(
    config: RunConfig,
    ckpt: LoadedCheckpoint,
    allow: bool,
    report: Report,
    identity: dict[str, Any] | None,
) -> list[Problem]:
    from perdure.checkpoint import (
        IncompatibleCheckpointError,
        check_compatible,
        config_override_entry,
    )
    from perdure.config.diff import diff_canonical

    digest, canon = config_hash(config, identity), canonical(config, identity)
    try:
        keys = check_compatible(ckpt, digest, canon, allow_config_change=allow)
    except IncompatibleCheckpointError:
        differ = ", ".join(diff_canonical(ckpt.canonical_config, canon)) or "none"
        rule = (
            f"written under config hash {ckpt.config_hash}, this run's is {digest} "
            f"(differing keys: {differ}); pass --allow-config-change "
            "(perdure.run(..., allow_config_change=True)) to resume anyway, recorded in the "
            "decision log"
        )
        return [Problem("--resume", rule, str(ckpt.path))]
    if keys:
        report.override = config_override_entry(ckpt, digest, keys)
        report.notes.append(
            f"--allow-config-change: resuming {ckpt.path} with {', '.join(keys)} changed "
            "(recorded in the decision log)"
        )
    return []


def _shapes(ckpt: LoadedCheckpoint, task: Task, path: str) -> list[Problem]:
    """The checkpoint's model tensors against the task's (names and shapes)."""
    from perdure.runtime.replica.task import plain_module

    want = {k: tuple(v.shape) for k, v in plain_module(task.model).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ckpt.model.items()}
    diffs = [
        f"{k} is {list(got[k])} in the checkpoint, {list(want[k])} in the model"
        for k in sorted(want.keys() & got.keys())
        if want[k] != got[k]
    ]
    diffs += [f"{k} missing" for k in sorted(want.keys() - got.keys())]
    diffs += [f"{k} not in the model" for k in sorted(got.keys() - want.keys())]
    if not diffs:
        return []
    more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
    rule = f"its model tensors do not fit the task's: {'; '.join(diffs[:3])}{more}"
    return [Problem("--resume", rule, path)]


__all__ = [
    "DEFAULT_DATASET",
    "PreflightError",
    "Report",
    "build_stdlib_dataset",
    "preflight",
    "stdlib_build_command",
]
