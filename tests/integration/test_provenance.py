from __future__ import annotations

import subprocess
from pathlib import Path

from perdure.provenance import UNKNOWN, commit_info, library_versions, provenance


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "task.py").write_text("x = 1\n")
    _git(repo, "add", "task.py")
    _git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init")
    return repo


def test_clean_repo_gives_its_head_sha_and_not_dirty(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    info = commit_info(repo / "task.py")
    assert info["sha"] == _git(repo, "rev-parse", "HEAD")
    assert info["dirty"] is False


def test_modified_tracked_file_marks_the_tree_dirty(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    (repo / "task.py").write_text("x = 2\n")
    info = commit_info(repo / "task.py")
    assert info["sha"] == _git(repo, "rev-parse", "HEAD")
    assert info["dirty"] is True


def test_outside_git_the_sha_is_explicitly_unknown(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text("x = 1\n")
    info = commit_info(tmp_path / "task.py")
    assert info == {"sha": UNKNOWN, "dirty": None, "root": None}


def test_versions_name_the_libraries_that_change_bits() -> None:
    import torch

    v = library_versions()
    assert v["torch"] == torch.__version__
    assert set(v) >= {"perdure", "torch", "numpy", "python", "platform"}


def test_provenance_of_an_unimportable_task_is_unknown() -> None:
    p = provenance("no_such_module_xyz:make")
    assert p["sha"] == UNKNOWN and p["task_entry"] == "no_such_module_xyz:make"
