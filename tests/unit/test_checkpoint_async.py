from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from perdure.checkpoint import (
    AsyncCheckpointer,
    CheckpointSaveError,
    list_checkpoints,
    load_checkpoint,
)
from perdure.checkpoint import async_save as async_mod
from perdure.checkpoint.config import CheckpointConfig
from tests.checkpoint_support import make_state, same_tree


def _events() -> tuple[list[dict[str, Any]], Any]:
    events: list[dict[str, Any]] = []
    return events, events.append


@pytest.mark.parametrize("overlap", [True, False])
def test_async_save_holds_the_state_at_save_time_not_later(tmp_path: Path, overlap: bool) -> None:
    events, log = _events()
    ck = AsyncCheckpointer(tmp_path, CheckpointConfig(snapshot_overlap=overlap), log=log)
    state = make_state(step=4)
    expected = {k: v.clone() for k, v in state.model.items()}
    assert ck.save(state)
    ck.wait_snapshot()
    for t in state.model.values():  # the step loop mutates parameters right after
        if t.is_floating_point() and t.numel():
            t.add_(1.0)
    state.data["cursor"] = -1
    ck.close()
    loaded = load_checkpoint(tmp_path / "step-000000004")
    assert same_tree(loaded.model, expected)
    assert loaded.data["cursor"] == 4096
    (saved,) = [e for e in events if e["event"] == "checkpoint_saved"]
    assert saved["step"] == 4 and saved["bytes"] > 0 and saved["seconds"] > 0
    assert saved["path"].endswith("step-000000004")


def _blocking_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    release = threading.Event()
    real = async_mod.write_checkpoint

    def slow(*a: Any, **k: Any) -> Path:
        release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(async_mod, "write_checkpoint", slow)
    return release


def test_busy_skip_skips_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = _blocking_writes(monkeypatch)
    events, log = _events()
    ck = AsyncCheckpointer(tmp_path, CheckpointConfig(on_busy="skip"), log=log)
    assert ck.save(make_state(step=1))
    assert not ck.save(make_state(step=2))
    assert {"event": "checkpoint_skipped", "step": 2, "reason": "save in flight"} in events
    release.set()
    ck.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001"]


def test_busy_wait_waits_and_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = _blocking_writes(monkeypatch)
    events, log = _events()
    ck = AsyncCheckpointer(tmp_path, CheckpointConfig(on_busy="wait"), log=log)
    assert ck.save(make_state(step=1))
    threading.Timer(0.3, release.set).start()
    assert ck.save(make_state(step=2))
    ck.close()
    waited = [e for e in events if e["event"] == "checkpoint_busy_wait"]
    assert waited and waited[0]["seconds"] >= 0.2
    assert len(list_checkpoints(tmp_path)) == 2


def test_background_error_surfaces_at_the_next_check_once(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    events, log = _events()
    ck = AsyncCheckpointer(blocker, CheckpointConfig(), log=log)
    ck.save(make_state(step=3))
    ck._thread.join()  # type: ignore[union-attr]
    with pytest.raises(CheckpointSaveError, match=r"background save of step 3 .* failed"):
        ck.check()
    ck.check()
    assert any(e["event"] == "checkpoint_failed" for e in events)
    ck.close()


def test_retention_keeps_last_n_and_every_kth(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path, CheckpointConfig(keep_last=2, keep_every=4))
    state = make_state(extra=False)
    for step in range(1, 10):
        state.step = step
        ck.save(state)
        ck.wait_snapshot()
    ck.close()
    assert [p.name[-2:] for p in list_checkpoints(tmp_path)] == ["04", "08", "09"]


def test_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    ck = AsyncCheckpointer(tmp_path, CheckpointConfig())
    state = make_state(extra=False)
    ck.save(state)
    ck.wait()
    first = {k: v.data_ptr() for k, v in ck._buffers._buffers.items()}
    state.step += 1
    state.model = {k: v + 1 for k, v in state.model.items()}
    ck.save(state)
    ck.wait()
    assert first == {k: v.data_ptr() for k, v in ck._buffers._buffers.items()}
    ck.close()
    loaded = load_checkpoint(tmp_path / f"step-{state.step:09d}")
    assert torch.equal(loaded.model["0.bias"], state.model["0.bias"])
