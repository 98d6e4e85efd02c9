from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from perdure.checkpoint import (
    IncompatibleCheckpointError,
    apply_retention,
    check_compatible,
    config_override_entry,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.discovery import retained
from perdure.config.errors import ConfigError
from tests.checkpoint_support import make_state


def _loaded(tmp_path: Path):  # type: ignore[no-untyped-def]
    return load_checkpoint(save_checkpoint(tmp_path, make_state()))


def test_same_config_hash_is_compatible(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    assert check_compatible(loaded, loaded.config_hash, loaded.canonical_config) == []


def test_other_config_hash_names_both_hashes_and_the_differing_keys(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    canonical = {"optim": {"lr": 0.5, "betas": (0.9, 0.99)}, "train": {"seed": 0}}
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_compatible(loaded, "sha256:ffff", canonical)
    msg = str(info.value)
    assert loaded.config_hash in msg and "sha256:ffff" in msg and "optim.lr" in msg
    assert "betas" not in msg


def test_override_returns_the_keys_and_a_decision_log_entry(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    canonical = {"optim": {"lr": 0.5, "betas": (0.9, 0.99)}, "train": {"seed": 0}}
    keys = check_compatible(loaded, "sha256:ffff", canonical, allow_config_change=True)
    assert keys == ["optim.lr"]
    entry = config_override_entry(loaded, "sha256:ffff", keys)
    assert entry["kind"] == "config_override" and entry["step"] == loaded.step
    assert (
        entry["details"]["from"] == loaded.config_hash and entry["details"]["to"] == "sha256:ffff"
    )


def test_other_commit_sha_warns_and_does_not_refuse(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path)
    with pytest.warns(UserWarning, match="commit deadbeef.*commit cafe"):
        check_compatible(loaded, loaded.config_hash, {}, provenance={"sha": "cafe"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_compatible(loaded, loaded.config_hash, {}, provenance={"sha": "deadbeef"})


def test_retention_never_deletes_the_newest_intact_checkpoint(tmp_path: Path) -> None:
    assert retained([1, 2, 3], CheckpointConfig(keep_last=1), newest_intact=2) == {2, 3}
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, make_state(step=step, extra=False))
    (tmp_path / "step-000000003" / "context.json").write_text("{}")  # corrupt the newest
    with pytest.warns(UserWarning, match="context.json"):
        apply_retention(tmp_path, CheckpointConfig(keep_last=1))
    assert [p.name[-1] for p in list_checkpoints(tmp_path)] == ["2", "3"]


def test_config_rejects_bad_fields_naming_them() -> None:
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointConfig(keep_last=0)
