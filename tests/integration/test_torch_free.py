"""The config layer, the plan and the control plane's policy import without torch: a
process that only checks configs, plans or simulates must not pay for it (issue 37)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports_without_torch(modules: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.modules['torch'] = None\nimport {modules}\nprint('ok')"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_the_config_the_plan_and_the_policy_import_with_torch_blocked() -> None:
    res = _imports_without_torch(
        "perdure.config, perdure.run_config, perdure.runtime.plan, "
        "perdure.runtime.control.policy, perdure.checkpoint"
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_a_checkpoint_name_that_needs_torch_says_so_when_it_is_asked_for() -> None:
    """The lazy re-export still fails, naming torch, where torch is really needed."""
    res = _imports_without_torch("perdure.checkpoint\nperdure.checkpoint.load_checkpoint")
    assert res.returncode == 1 and "torch" in res.stderr


def test_every_re_exported_checkpoint_name_resolves() -> None:
    import importlib

    import perdure.checkpoint as ckpt

    for name in ckpt.__all__:
        home = importlib.import_module(ckpt._EXPORTS[name])
        assert getattr(ckpt, name) is getattr(home, name), name


def test_the_coordinator_starts_serves_the_store_and_writes_tensorboard_with_torch_blocked(
    tmp_path: Path,
) -> None:
    """The coordinator never imports torch (its start-up was 1.5-2.5 s of CPU of it, for a
    dictionary, and its first TensorBoard point as much again): its CLI, its control plane,
    the store's server and the TensorBoard writer run without it."""
    code = "\n".join(
        [
            "import socket",
            "import perdure.__main__, perdure.cli.worker",
            "from perdure.runtime.control.coordinator import Coordinator",
            "from perdure.runtime.control.store import StoreServer",
            "from perdure.runtime.control.store_wire import handshake, recv_frame, send_frame",
            "server = StoreServer('127.0.0.1', 0, 'tok')",
            "sock = socket.create_connection(('127.0.0.1', server.port), timeout=10)",
            "assert handshake(sock, 'tok')['ok']",
            "def call(header, blobs=()):",
            "    send_frame(sock, header, blobs)",
            "    return recv_frame(sock)",
            "call({'op': 'set', 'keys': ['k']}, (b'v',))",
            "print(call({'op': 'get', 'keys': ['k'], 'timeout_ms': 1000})[1][0].decode())",
            "print(call({'op': 'add', 'keys': ['n'], 'n': 5})[0]['n'])",
            "print(call({'op': 'wait', 'keys': ['absent'], 'timeout_ms': 50})[0]['timeout'])",
            "server.close()",
            "from pathlib import Path",
            "from perdure.metrics.tensorboard import Point, TensorBoardSink",
            f"sink = TensorBoardSink(Path({str(tmp_path)!r}), takeover=False)",
            "print(sink.write([Point('train/loss', 3, 1.5, 3, 1e9)]))",
            "sink.close()",
        ]
    )
    res = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["v", "5", "True", "1"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    [point] = acc.Scalars("train/loss")
    assert (point.step, point.value, point.wall_time) == (3, 1.5, 1e9)
