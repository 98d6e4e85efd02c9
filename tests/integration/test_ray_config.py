"""The Ray launcher's choices that need no cluster: its config, where each process is
placed, and what a cluster must offer before a run may start (pure functions; no Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from perdure.config.errors import ConfigError
from perdure.launch.api import run
from perdure.launch.ray import coordinator_command, needed_regions, placement, region_problems
from perdure.run_config import config_from_dict, to_dict
from tests.runtime_support import small_config


def _node(resources: dict[str, float], labels: dict[str, str] | None = None, alive: bool = True):
    return {"Alive": alive, "Resources": resources, "Labels": labels or {}}


def _cfg(tmp_path: Path, **ray: object):
    return small_config(tmp_path, workers=3, regions=2, ray=ray)  # r0: 2 workers, r1: 1


def test_every_region_of_workers_spares_and_coordinators_is_needed(tmp_path: Path) -> None:
    cfg = small_config(
        tmp_path, workers=2, regions=2, cluster={"spares": 1, "standby_region": "r1"}
    )
    assert needed_regions(cfg) == {"r0": 2.0, "r1": 1.0}  # r0: a worker and the spare
    cfg = small_config(tmp_path, workers=1, regions=1, ray={"worker_cpus": 0.5})
    assert needed_regions(cfg) == {"r0": 0.5}


def test_a_process_asks_for_a_sliver_of_its_regions_resource_or_for_its_label(
    tmp_path: Path,
) -> None:
    assert placement(_cfg(tmp_path).ray, "r1") == {"resources": {"region:r1": 0.01}}
    rc = _cfg(tmp_path, placement="label", label="zone").ray
    assert placement(rc, "r1") == {"label_selector": {"zone": "r1"}}


def test_a_cluster_with_every_region_and_enough_cpus_has_no_problem(tmp_path: Path) -> None:
    nodes = [_node({"CPU": 2, "region:r0": 1}), _node({"CPU": 1, "region:r1": 1})]
    assert region_problems(_cfg(tmp_path), nodes) == []


def test_a_missing_region_names_its_resource_and_the_flag_that_adds_it(tmp_path: Path) -> None:
    nodes = [_node({"CPU": 8, "region:r0": 1}), _node({"CPU": 8, "region:r1": 1}, alive=False)]
    [p] = region_problems(_cfg(tmp_path), nodes)
    assert p.key == "cluster.regions (r1)"
    assert "resource region:r1" in p.rule and """--resources '{"region:r1": 1}'""" in p.rule
    assert p.value == ["region:r0"]  # what the alive nodes offer


def test_a_missing_label_names_the_label_flag(tmp_path: Path) -> None:
    nodes = [_node({"CPU": 8}, {"region": "r0"})]
    [p] = region_problems(_cfg(tmp_path, placement="label"), nodes)
    assert "label region=r1" in p.rule and "--labels region=r1" in p.rule


def test_a_region_short_of_cpus_or_a_cluster_short_of_gpus_is_a_problem(tmp_path: Path) -> None:
    nodes = [_node({"CPU": 1, "region:r0": 1}), _node({"CPU": 1, "region:r1": 1})]
    [p] = region_problems(_cfg(tmp_path), nodes)
    assert p.key == "ray.worker_cpus (r0)" and "reserve 2 CPUs; its nodes have 1" in p.rule
    nodes = [_node({"CPU": 4, "GPU": 1, "region:r0": 1}), _node({"CPU": 4, "region:r1": 1})]
    [p] = region_problems(_cfg(tmp_path, worker_gpus=1.0), nodes)
    assert p.key == "ray.worker_gpus" and "reserve 3 GPUs; the cluster has 1" in p.rule


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_a_coordinator_on_ray_binds_and_advertises_its_nodes_address_and_writes_no_summary(
    tmp_path: Path,
) -> None:
    """Through ``perdure coordinator --host/--advertise`` (the config's ``cluster.host`` is
    for the local launcher); summary.json is the driver's, once every process stopped."""
    cfg, rd = tmp_path / "config.json", tmp_path / "run"
    primary = coordinator_command(cfg, rd, "coordinator", "10.0.0.7", expected=3)
    assert _flag(primary, "--host") == _flag(primary, "--advertise") == "10.0.0.7"
    assert _flag(primary, "--config-json") == str(cfg) and "--no-summary" in primary
    assert "--standby" not in primary and "--channel-port" not in primary
    standby = coordinator_command(cfg, rd, "standby", "fd00::2", expected=3, resume="ck")
    assert _flag(standby, "--host") == _flag(standby, "--advertise") == "fd00::2"
    assert "--standby" in standby and "--no-summary" in standby
    assert _flag(standby, "--channel-port") == _flag(standby, "--store-port") == "0"
    assert _flag(standby, "--resume") == "ck"
    assert _flag(standby, "--ports-file") == str(rd / "standby.json")


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("address", "head", "must be HOST:PORT"),
        ("address", "head:6379:1", "must be HOST:PORT"),
        ("placement", "node", "must be one of"),
        ("worker_cpus", -1.0, ">= 0"),
        ("start_timeout_s", 0.0, "> 0"),
        ("label", " ", "must not be empty"),
    ],
)
def test_a_bad_ray_field_is_refused_naming_it(
    tmp_path: Path, field: str, value: object, rule: str
) -> None:
    data = to_dict(small_config(tmp_path))
    data["ray"][field] = value
    with pytest.raises(ConfigError, match=rf"ray\.{field}: .*{rule}"):
        config_from_dict(data)


@pytest.mark.parametrize("address", ["auto", "local", "10.0.0.1:6379", "ray://head:10001"])
def test_the_documented_addresses_are_accepted(tmp_path: Path, address: str) -> None:
    assert small_config(tmp_path, ray={"address": address}).ray.address == address


def test_an_unknown_launcher_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--launcher: must be one of \['local', 'ray'\]"):
        run(small_config(tmp_path), run_dir=tmp_path / "run", launcher="slurm")
    assert not (tmp_path / "run").exists()


def test_ray_address_without_the_ray_launcher_is_a_usage_error(tmp_path: Path) -> None:
    from tests.ray_support import write_toml

    cfg = write_toml(to_dict(small_config(tmp_path)), tmp_path / "run.toml")
    out = subprocess.run(
        [sys.executable, "-m", "perdure", "run", str(cfg), "--ray-address", "head:6379"],
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert b"--ray-address: needs --launcher ray" in out.stderr


def test_cuda_on_ray_needs_a_whole_gpu_per_worker_unless_the_data_plane_is_gloo(
    tmp_path: Path,
) -> None:
    from perdure.launch.ray import device_problems
    from perdure.run_config import with_overrides

    def problems(gpus: float, plane: str = "auto", device: str = "cuda"):  # type: ignore[no-untyped-def]
        cfg = with_overrides(
            _cfg(tmp_path, worker_gpus=gpus),
            train={"device": device},
            cluster={"data_plane": plane},
        )
        return device_problems(cfg)

    [p] = problems(0.0)
    assert p.key == "ray.worker_gpus" and "hides the GPUs" in p.rule and p.value == 0.0
    [p] = problems(0.5)
    assert "NCCL refuses" in p.rule and "cluster.data_plane = 'gloo'" in p.rule
    assert problems(0.5, "gloo") == [] and problems(1.0) == [] and problems(2.0, "nccl") == []
    assert problems(0.0, device="cpu") == []


def test_the_driver_of_a_ray_run_is_not_asked_for_cuda(tmp_path: Path) -> None:
    """The workers run on the cluster's nodes: preflight on a driver without CUDA refuses
    ``cuda`` for the local launcher only."""
    from perdure.launch.preflight import PreflightError, preflight
    from perdure.run_config import with_overrides

    cfg = with_overrides(_cfg(tmp_path, worker_gpus=1.0), train={"device": "cuda"})
    if not torch.cuda.is_available():
        with pytest.raises(PreflightError, match=r"train\.device"):
            preflight(cfg, launcher="local")
    with pytest.raises(PreflightError) as got:  # the dataset is missing: nothing else
        preflight(cfg, launcher="ray")
    assert "train.device" not in str(got.value)
