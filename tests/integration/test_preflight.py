"""Preflight: what every worker would fail on identically is refused before any starts,
each problem naming its field or flag, the rule and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from perdure.checkpoint import save_checkpoint
from perdure.cli import main
from perdure.launch import preflight as pf
from perdure.launch.preflight import PreflightError, preflight
from perdure.run_config import RunConfig, load_config, with_overrides
from perdure.runtime.replica.task import resolve
from perdure.runtime.replica.trainer import Trainer
from tests.runtime_support import small_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").glob("*.toml"))


def _problems(config: RunConfig, **kw: Any) -> list[tuple[str, str, object]]:
    with pytest.raises(PreflightError) as info:
        preflight(config, **kw)
    return [(p.key, p.rule, p.value) for p in info.value.problems]


def test_a_task_entry_that_does_not_import_is_refused_naming_the_entry(
    small_dataset: Path,
) -> None:
    cfg = small_config(small_dataset, task={"entry": "examples.nope:make_task"})
    [(key, rule, value)] = _problems(cfg)
    assert key == "task.entry" and "cannot import module 'examples.nope'" in rule
    assert value == "examples.nope:make_task"


def test_a_factory_that_rejects_its_options_is_refused_naming_the_options(
    small_dataset: Path,
) -> None:
    cfg = small_config(small_dataset, task={"options": {"width": 3}})
    [(key, rule, value)] = _problems(cfg)
    assert key == "task.options" and "unexpected keyword argument 'width'" in rule
    assert value == {"width": 3}


def test_a_vocabulary_smaller_than_the_datasets_is_refused_naming_both_numbers(
    small_dataset: Path,
) -> None:
    cfg = small_config(small_dataset, task={"options": {"d_model": 32, "vocab": 100}})
    [(key, rule, _)] = _problems(cfg)
    assert key == "task.options" and "vocab_size 100" in rule and "dataset's 256" in rule


def test_samples_longer_than_the_model_reads_are_refused(small_dataset: Path) -> None:
    cfg = small_config(small_dataset, task={"options": {"d_model": 32, "max_len": 32}})
    [(key, rule, _)] = _problems(cfg)
    assert key == "task.options" and "max_len 32" in rule and "seq_len 64" in rule


def test_a_batch_larger_than_the_dataset_is_refused(small_dataset: Path) -> None:
    cfg = small_config(small_dataset, batch=2**40, slots=16)
    [(key, rule, value)] = _problems(cfg)
    assert key == "train.global_batch" and "at most the dataset's" in rule and value == 2**40


@pytest.mark.parametrize("kind", ["poison_part", "corrupt_part"])
def test_a_poisoned_or_corrupted_part_past_the_last_one_is_refused(
    small_dataset: Path, kind: str
) -> None:
    fault = {"kind": kind, "target": "999", "at_step": 3}
    cfg = small_config(small_dataset, chaos={"faults": [fault]})
    [(key, rule, value)] = _problems(cfg)
    assert key == "chaos.faults[0].target" and "must be a part of" in rule and value == "999"


def test_a_duration_past_what_timers_can_wait_is_refused(small_dataset: Path) -> None:
    cfg = small_config(small_dataset, cluster={"join_timeout_ms": 10**16})
    [(key, rule, _)] = _problems(cfg)
    assert key == "cluster.join_timeout_ms" and "at most" in rule


def test_a_missing_dataset_names_the_command_that_builds_it(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "nothing")
    [(key, rule, _)] = _problems(cfg)
    assert key == "data.dataset" and f"perdure data build SOURCES --out {tmp_path}" in rule
    assert f"perdure data import FILES --out {tmp_path}" in rule  # arrays: the other kind


def test_the_shipped_default_dataset_is_built_by_run_and_only_noted_by_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pf, "STDLIB_MAX_MB", 0.2)
    shipped = load_config(ROOT / "configs/quick.toml")  # relative to the repository root:
    cfg = with_overrides(shipped, train={"global_batch": 16}, run={"base_dir": str(tmp_path)})
    checked = preflight(cfg)
    assert "perdure data build" in checked.notes[0] and not (tmp_path / "runs").exists()
    said: list[str] = []
    built = preflight(cfg, build_default=True, say=said.append)
    assert (tmp_path / pf.DEFAULT_DATASET / "manifest.json").exists()
    assert said and "built" in built.notes[0]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_passes_preflight_given_a_dataset(
    path: Path, small_dataset: Path
) -> None:
    cfg = with_overrides(load_config(path), data={"dataset": str(small_dataset)})
    resolve(cfg.task.entry)  # the task's own imports (transformers: seconds) are not preflight's
    assert preflight(cfg).seconds < 10


def _checkpoint(config: RunConfig, root: Path) -> str:
    trainer = Trainer(config)
    try:
        return str(save_checkpoint(root, trainer.checkpoint_state({})))
    finally:
        trainer.close()


def test_a_checkpoint_of_another_config_is_refused_naming_the_flag(
    small_dataset: Path, tmp_path: Path
) -> None:
    ckpt = _checkpoint(small_config(small_dataset), tmp_path)
    changed = small_config(small_dataset, optim={"lr": 1e-3})
    [(key, rule, value)] = _problems(changed, resume=ckpt)
    # the default optimizer's group carries the rate too: the recipe differs with the config
    keys = "differing keys: identity.recipe.param_groups.0.lr, optim.lr"
    assert key == "--resume" and keys in rule
    assert "--allow-config-change" in rule and value == ckpt
    allowed = preflight(changed, resume=ckpt, allow_config_change=True)
    assert allowed.override is not None and allowed.override["kind"] == "config_override"
    assert allowed.override["details"]["keys"] == ["identity.recipe.param_groups.0.lr", "optim.lr"]


def test_a_checkpoint_whose_tensors_do_not_fit_the_model_is_refused(
    small_dataset: Path, tmp_path: Path
) -> None:
    ckpt = _checkpoint(small_config(small_dataset), tmp_path)
    wider = small_config(
        small_dataset, task={"options": {"d_model": 64, "n_layers": 1, "n_heads": 2}}
    )
    problems = _problems(wider, resume=ckpt, allow_config_change=True)
    assert [k for k, _, _ in problems] == ["--resume"]
    assert "do not fit the task's" in problems[0][1]
    assert "linear1.bias is [128] in the checkpoint, [256] in the model" in problems[0][1]


def test_a_resume_checkpoint_with_a_flipped_bit_is_refused_naming_the_file(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Ranks sharded at rest read only byte ranges and check no file's CRC: the preflight
    checks every file once, so a corrupt tensor file stops the run before it starts."""
    cfg = small_config(small_dataset)
    ckpt = Path(_checkpoint(cfg, tmp_path))
    part = next(ckpt.glob("tensors-*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x10
    part.write_bytes(bytes(data))
    [(key, rule, value)] = _problems(cfg, resume=str(ckpt))
    assert key == "--resume" and value == str(ckpt)
    assert f"{part}: checksum mismatch" in rule


def _write(tmp_path: Path, dataset: Path, options: str = "", train: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(
        f"[task]\noptions = {{ d_model = 32, n_layers = 1, n_heads = 2{options} }}\n"
        f"[train]\nsteps = 4\nslots = 8\n{train or 'global_batch = 16'}\n"
        f'[data]\ndataset = "{dataset}"\n'
        '[cluster]\nregions = [{ name = "r0", workers = 1 }]\n'
    )
    return path


def test_config_check_prints_each_problem_in_one_line_and_exits_2(
    small_dataset: Path, tmp_path: Path
) -> None:
    path = _write(tmp_path, small_dataset, train=f"global_batch = {2**40}")
    res = CliRunner().invoke(main, ["config", "check", str(path)])
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [
        f"preflight of {path}: train.global_batch: must be at most the dataset's "
        f"{_samples(small_dataset)} samples ({small_dataset}) (got {2**40})"
    ]


def test_perdure_run_refuses_before_any_process_starts(small_dataset: Path, tmp_path: Path) -> None:
    path = _write(tmp_path, small_dataset, options=", vocab = 100")
    run_dir = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", str(path), "--run-dir", str(run_dir), "--no-live"])
    assert res.exit_code == 2 and "vocab_size 100" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not run_dir.exists()


def _samples(dataset: Path) -> int:
    from perdure.data import Dataset

    with Dataset.open(str(dataset)) as ds:
        return ds.num_samples


def test_a_vocabulary_the_undeclared_embedding_cannot_read_is_named_by_both_sizes(
    small_dataset: Path,
) -> None:
    task = {"entry": "tests.recipe_task:undeclared_vocab", "options": {"vocab": 64}}
    problems = _problems(small_config(small_dataset, task=task))
    rules = [rule for key, rule, _ in problems if key == "task.options"]
    assert any("vocabulary is 256 token ids" in r and "embedding 'tok' has 64 rows" in r
               for r in rules), problems  # fmt: skip


@pytest.mark.parametrize(
    "entry,says",
    [
        ("tests.recipe_task:with_scheduler", "brings its own scheduler"),
        ("tests.buffer_task:make_task", "forward moves buffers"),
    ],
)
def test_diloco_with_a_tasks_scheduler_or_moving_buffers_is_refused_before_workers_start(
    small_dataset: Path, entry: str, says: str
) -> None:
    cfg = small_config(
        small_dataset, slots=4, task={"entry": entry, "options": {}},
        optim={"schedule": "constant", "warmup_steps": 0},
        outer={"replicas": 4, "inner_steps": 2},
    )  # fmt: skip
    problems = _problems(cfg)
    assert [key for key, _, _ in problems] == ["outer.replicas"], problems
    assert says in problems[0][1]
