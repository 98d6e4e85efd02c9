from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from perdure.config.diff import diff_canonical
from perdure.config.errors import ConfigError
from perdure.run_config import (
    RunConfig,
    canonical,
    config_from_dict,
    config_hash,
    load_config,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").glob("*.toml"))


def test_there_are_shipped_configs() -> None:
    assert len(SHIPPED) >= 2


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert config_hash(cfg).startswith("sha256:")


def _problems(data: dict) -> list[tuple[str, str, object]]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return [(p.key, p.rule, p.value) for p in info.value.problems]


def test_error_names_key_rule_and_value() -> None:
    problems = _problems({"optim": {"lr": -0.5}})
    assert problems == [("optim.lr", "must be a finite number > 0", -0.5)]


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        '[optim]\nlr = -1\nbogus = 3\n[train]\nsteps = "x"\nglobal_batch = 30\nslots = 16\n'
        '[cluster]\nregions = [{ name = "a", workers = -1 }]\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    keys = {p.key for p in info.value.problems}
    assert keys == {
        "optim.lr",
        "optim.bogus",
        "train.steps",
        "train.global_batch",
        "cluster.regions[0].workers",
    }
    text = str(info.value)
    assert str(path) in text and "5 problems" in text
    assert "must be an integer (got 'x')" in text


def test_unknown_section_and_wrong_type_are_named() -> None:
    problems = _problems({"trian": {}, "train": {"seed": True}})
    assert ("train.seed", "must be an integer", True) in problems
    assert any(k == "trian" and "unknown key" in r for k, r, _ in problems)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match=r"broken\.toml.*not valid TOML"):
        load_config(path)


def test_fault_targets_are_checked_against_the_cluster() -> None:
    problems = _problems(
        {"chaos": {"faults": [{"kind": "kill", "target": "mars-0", "at_step": 3}]}}
    )
    assert problems == [("chaos.faults[0].target", "no such worker", "mars-0")]


def test_hash_ignores_workers_regions_paths_and_checkpoint_settings() -> None:
    base = RunConfig()
    other = with_overrides(
        base,
        cluster={"regions": [{"name": "x", "workers": 7}, {"name": "y", "workers": 1}]},
        data={"dataset": "/elsewhere", "cache_mb": 5},
        checkpoint={"every_steps": 3},
        run={"dir": "/tmp/somewhere"},
    )
    assert other != base
    assert config_hash(other) == config_hash(base)


@pytest.mark.parametrize(
    "section,field,value",
    [
        ("optim", "lr", 1e-4),
        ("train", "seed", 7),
        ("train", "slots", 8),
        ("train", "threads_per_worker", 2),
    ],
)
def test_hash_changes_with_math_fields(section: str, field: str, value: object) -> None:
    base = RunConfig()
    other = with_overrides(base, **{section: {field: value}})
    assert config_hash(other) != config_hash(base)
    assert diff_canonical(canonical(base), canonical(other)) == [f"{section}.{field}"]


def test_configs_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        RunConfig(None)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().train.steps = 3  # type: ignore[misc]


def test_configuration_reference_is_generated_from_the_code() -> None:
    from perdure.run_config.reference import reference_markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == reference_markdown(), "run: perdure config fields > docs/configuration.md"


def test_every_config_field_has_a_docstring() -> None:
    import dataclasses

    from perdure.chaos.config import FaultConfig
    from perdure.run_config.reference import field_docs
    from perdure.runtime.config import RegionConfig

    sections = [f.default_factory().__class__ for f in dataclasses.fields(RunConfig)]  # type: ignore[misc]
    for cls in [*sections, RegionConfig, FaultConfig]:
        if cls is RunConfig:
            continue
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
        assert not missing, f"{cls.__name__}: fields without a docstring: {missing}"


@pytest.mark.parametrize("key", ["lr", "weight_decay", "eps"])
def test_an_infinite_or_nan_optimizer_setting_is_refused_before_any_worker_starts(
    key: str, tmp_path: Path
) -> None:
    for text in ("inf", "nan"):
        path = tmp_path / f"{key}-{text}.toml"
        path.write_text(f"[optim]\n{key} = {text}\n")
        with pytest.raises(ConfigError) as info:
            load_config(path)
        [problem] = info.value.problems
        assert problem.key == f"optim.{key}" and "finite number" in problem.rule


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_config_check_passes_for_every_shipped_config_from_the_root_and_elsewhere(
    path: Path, tmp_path: Path
) -> None:
    """`perdure config check` as a user types it, from the repository root (a relative
    path) and from an unrelated directory (an absolute one): the task's module and the
    dataset are found from the config's ``run.base_dir`` either way."""
    import subprocess
    import sys

    perdure = [sys.executable, "-c", "from perdure.cli import main; main()"]
    for cwd, arg in ((ROOT, str(path.relative_to(ROOT))), (tmp_path, str(path))):
        done = subprocess.run(
            [*perdure, "config", "check", arg], cwd=cwd, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (cwd, done.stderr[-2000:])
        assert "sha256:" in done.stdout


def test_the_default_reduction_is_the_streamed_exact_sum_on_32_bits() -> None:
    train = RunConfig().train
    assert (train.reduction, train.reduction_bits, train.reduction_exponents) == (
        "exact",
        32,
        "streamed",
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"reduction_bits": 64},
        {"reduction_exponents": "carried", "reduction_bits": 64, "reduction_block": 64},
    ],
)
def test_a_chain_run_hashes_as_before_the_default_changed_whatever_the_exact_fields(
    fields: dict,
) -> None:
    """The chain ignores the exact reduction's fields: they enter its hash as the values
    every chain run had (64 bits, step exponents, blocks of 256), so a checkpoint made
    with the chain resumes under ``reduction = "chain"`` without a config change."""
    chain = with_overrides(RunConfig(), train={"reduction": "chain", **fields})
    train = canonical(chain)["train"]
    assert train["reduction"] == "chain"
    assert (train["reduction_bits"], train["reduction_exponents"]) == (64, "step")
    assert train["reduction_block"] == 256
    old = with_overrides(
        RunConfig(),
        train={"reduction": "chain", "reduction_bits": 64, "reduction_exponents": "step"},
    )
    assert config_hash(chain) == config_hash(old)


def test_the_exact_fields_enter_the_hash_of_an_exact_run() -> None:
    base = RunConfig()
    wide = with_overrides(base, train={"reduction_bits": 64})
    assert diff_canonical(canonical(base), canonical(wide)) == ["train.reduction_bits"]


def test_a_prepared_config_class_builds_without_evaluating_an_annotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zygote prepares RunConfig before it forks: a worker's config is then built from
    evaluated annotations (16 ms of a replacement's start-up otherwise)."""
    import importlib
    import typing

    build = importlib.import_module("perdure.config.build")  # the package's `build` is a function
    want = load_config(SHIPPED[0])
    data = dataclasses.asdict(want)
    monkeypatch.setattr(build, "_HINTS", {})  # not what the load above evaluated
    build.prepare(RunConfig)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("an annotation was evaluated after prepare()")

    monkeypatch.setattr(typing, "get_type_hints", refused)
    assert config_from_dict(data) == want


def test_a_bad_copy_pace_or_step_is_refused_and_neither_is_part_of_the_hash() -> None:
    assert _problems({"cluster": {"copy_step_mb": 0.0}}) == [
        ("cluster.copy_step_mb", "must be a finite number > 0", 0.0)
    ]
    assert _problems({"cluster": {"copy_step_mb": float("inf")}})[0][0] == "cluster.copy_step_mb"
    assert _problems({"cluster": {"copy_pace": "sometimes"}})[0][0] == "cluster.copy_pace"
    paced = config_from_dict({"cluster": {"copy_pace": "fixed", "copy_step_mb": 8.0}})
    assert config_hash(paced) == config_hash(config_from_dict({}))
