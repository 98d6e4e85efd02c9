"""A run's zygote pins the task's commit: its forked workers name the commit of the code
they run (imported at the pin), not a commit made on disk afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure import provenance


def test_a_pinned_commit_is_answered_after_the_tree_moves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head = {"sha": "a" * 40}

    def fake_git(path: Path, *args: str) -> str | None:
        return {"HEAD": head["sha"], "--porcelain": "", "--show-toplevel": str(path)}[
            next(a for a in args if a in ("HEAD", "--porcelain", "--show-toplevel"))
        ]

    monkeypatch.setattr(provenance, "_git", fake_git)
    monkeypatch.setattr(provenance, "_PINNED", {})
    src = provenance.task_source("tests.buffer_task")
    assert src is not None
    provenance.pin_commit("tests.buffer_task")
    head["sha"] = "b" * 40  # a commit after the zygote imported the task
    assert provenance.commit_info(src)["sha"] == "a" * 40
    assert provenance.provenance("tests.buffer_task:make_task")["sha"] == "a" * 40
    assert provenance.commit_info(Path(provenance.__file__))["sha"] == "b" * 40  # not pinned


def test_a_module_that_cannot_be_found_pins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provenance, "_PINNED", {})
    provenance.pin_commit("no_such_module_for_provenance_xyz")
    assert provenance._PINNED == {}
