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
