"""A process of a run finds the task and the dataset from the config, wherever it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perdure.config.digest import hash_canonical
from perdure.data import Dataset
from perdure.run_config import dataset_path, load_config

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path: Path, small_dataset: Path) -> Path:
    """A config beside its own task module and dataset, in no importable place."""
    proj = tmp_path / "project"
    (proj / "conf").mkdir(parents=True)
    (proj / "my_task.py").write_text(
        "from examples.tiny_lm.task import make_task as _make\n\n\n"
        "def make_task(**options):\n    return _make(**options)\n"
    )
    (proj / "data").symlink_to(small_dataset)
    (proj / "conf" / "run.toml").write_text(
        '[task]\nentry = "my_task:make_task"\n'
        "options = { d_model = 32, n_layers = 1, n_heads = 2, max_len = 128 }\n"
        '[train]\nsteps = 10\nglobal_batch = 16\nslots = 8\n[run]\nbase_dir = ".."\n'
        '[data]\ndataset = "data"\n'
    )
    return proj / "conf" / "run.toml"


def test_relative_paths_resolve_from_the_config_files_directory(
    tmp_path: Path, small_dataset: Path
) -> None:
    cfg = load_config(_project(tmp_path, small_dataset))
    assert cfg.run.base_dir == str((tmp_path / "project").resolve())
    assert dataset_path(cfg) == str((tmp_path / "project").resolve() / "data")
    plain = tmp_path / "plain.toml"
    plain.write_text('[data]\ndataset = "ds"\n')
    assert dataset_path(load_config(plain)) == str(tmp_path.resolve() / "ds")


def test_the_task_module_and_dataset_are_found_from_another_working_directory(
    tmp_path: Path, small_dataset: Path
) -> None:
    """Started elsewhere, ``perdure config check`` builds the config's own task and opens its
    own dataset: the run's identity holds that dataset's version id and the task's recipe,
    and the printed hash is the hash of exactly that canonical config."""
    cfg = _project(tmp_path, small_dataset)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "perdure", "config", "check", "--canonical", str(cfg)],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ok, hashed, *rest = out.stdout.splitlines()
    assert ok.startswith(f"{cfg}: ok (preflight ") and ok.endswith(" s)")
    canon = json.loads("\n".join(rest))
    assert hashed == f"config hash: {hash_canonical(canon)}"
    with Dataset.open(str(small_dataset)) as ds:
        assert canon["identity"]["dataset"] == ds.version_id
    assert canon["identity"]["recipe"]["optimizer"] == "torch.optim.adamw.AdamW"  # the task's
    assert canon["identity"]["loss_reduction"] == "sum"
    assert canon["task"]["entry"] == "my_task:make_task"
