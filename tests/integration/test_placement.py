"""Where a replica's tensors live (``runtime/replica/placement.py``): the CPU here; ``cuda`` refused
before any worker starts on a host without CUDA, naming the field; the CUDA placements'
choices checked with CUDA's presence faked (no GPU runs them here: see the module doc)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from perdure.config import ConfigError
from perdure.launch.preflight import PreflightError
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.entry import WorkerSpec
from perdure.runtime.replica import placement as pl
from perdure.runtime.replica.placement import Placement
from tests.runtime_support import run_to_end, small_config

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")


def _cfg(device: str = "cpu", plane: str = "auto") -> RunConfig:
    return with_overrides(RunConfig(), train={"device": device}, cluster={"data_plane": plane})


def test_the_cpu_places_everything_on_the_cpu_with_gloo() -> None:
    c = _cfg()
    got = Placement.of(c.train, c.cluster)
    assert got == Placement(torch.device("cpu"), torch.device("cpu"), "gloo")


def test_nccl_without_cuda_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.data_plane.*needs train\.device = 'cuda'"):
        _cfg("cpu", "nccl")


@needs_no_cuda
def test_cuda_on_a_host_without_it_fails_before_any_worker_starts_naming_the_field(
    small_dataset: Path, tmp_path: Path
) -> None:
    config = small_config(small_dataset, workers=2, steps=4, train={"device": "cuda"})
    run_dir = tmp_path / "run"
    with pytest.raises(PreflightError) as info:
        run_to_end(config, run_dir)
    text = str(info.value)
    assert "train.device" in text and "torch.cuda.is_available() is False" in text
    assert "'cuda'" in text
    assert not (run_dir / "logs").exists()  # no process of the run was started
    c = _cfg("cuda")
    with pytest.raises(ValueError, match=r"^train\.device: 'cuda' needs a CUDA device"):
        Placement.of(c.train, c.cluster)  # a worker started by hand refuses the same way


def test_cuda_takes_its_gpu_by_local_index_with_nccl_or_stages_through_the_host_with_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    c = _cfg("cuda")
    got = Placement.of(c.train, c.cluster, local_index=3)
    assert got == Placement(torch.device("cuda", 1), torch.device("cuda", 1), "nccl")
    g = _cfg("cuda", "gloo")
    shared = Placement.of(g.train, g.cluster, local_index=0)
    assert shared == Placement(torch.device("cuda", 0), torch.device("cpu"), "gloo")


def test_the_deterministic_cuda_settings_are_set_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
    )
    try:
        pl.deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == pl.CUBLAS_WORKSPACE
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Fake")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
        place = Placement(torch.device("cuda", 0), torch.device("cuda", 0), "nccl")
        got = pl.determinism(place)  # what a checkpoint records of them
        assert got["cublas_workspace_config"] == ":4096:8" and got["matmul_allow_tf32"] is False
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic,
        ) = saved


def test_a_workers_gpu_index_travels_on_its_command_line() -> None:
    spec = WorkerSpec(name="r0-1", region="r0", coordinators=["127.0.0.1:1"], device_index=1)
    argv = spec.argv()
    assert argv[argv.index("--device-index") + 1] == "1"
    assert "--device-index" not in WorkerSpec(name="a", region="r", coordinators=["h:1"]).argv()


def test_a_checkpoint_records_the_placement_and_settings_in_force(
    small_dataset: Path, tmp_path: Path
) -> None:
    from perdure.checkpoint import load_checkpoint, save_checkpoint
    from perdure.runtime.replica.trainer import Trainer

    cfg = small_config(small_dataset, workers=1, steps=2)
    trainer = Trainer(cfg, cache_dir=str(tmp_path / "cache"))
    try:
        path = save_checkpoint(tmp_path / "ck", trainer.checkpoint_state({}))
    finally:
        trainer.close()
    got = load_checkpoint(path).provenance["determinism"]
    assert got == {
        "device": "cpu",
        "buffers": "cpu",
        "data_plane": "gloo",
        "deterministic_algorithms": True,
        "intra_op_threads": cfg.train.threads_per_worker,
    }


def test_the_cuda_record_reads_the_settings_back_from_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CUDA's queries faked: what is recorded is what torch reports, TF32 included
    (here left on, as a user's code might: the record must show it)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    place = Placement(torch.device("cuda", 0), torch.device("cpu"), "gloo")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = pl.determinism(place)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert got["device"] == "cuda:0" and got["buffers"] == "cpu" and got["data_plane"] == "gloo"
    assert got["device_name"] == "Fake H200" and got["capability"] == [9, 0]
    assert got["matmul_allow_tf32"] is True and got["cublas_workspace_config"] == ":16:8"
    assert got["cudnn_deterministic"] == torch.backends.cudnn.deterministic
