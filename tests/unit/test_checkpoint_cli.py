from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from perdure.checkpoint import save_checkpoint, state_digest
from perdure.cli import main
from tests.checkpoint_support import make_state


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["ckpt", *args])
    return result.exit_code, result.output


def test_hash_prints_exactly_the_in_memory_state_digest(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    code, out = _run("hash", str(path))
    assert code == 0
    assert out.strip() == state_digest(state.model, state.optimizer)


def test_hash_of_a_root_uses_its_newest_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(step=1, seed=1))
    newest = make_state(step=2, seed=2)
    save_checkpoint(tmp_path, newest)
    code, out = _run("hash", str(tmp_path))
    assert code == 0 and out.strip().endswith(state_digest(newest.model, newest.optimizer))


def test_verify_exits_nonzero_and_names_the_bad_file(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    assert _run("verify", str(path))[0] == 0
    (part,) = path.glob("*.safetensors")
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    code, out = _run("verify", str(path))
    assert code == 1 and part.name in out and "checksum mismatch" in out


def test_ls_lists_committed_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20):
        save_checkpoint(tmp_path, make_state(step=step, extra=False))
    code, out = _run("ls", str(tmp_path), "--verify")
    assert code == 0 and "step-000000010" in out and "step-000000020" in out
    assert out.count("verified") == 2


def test_inspect_shows_the_seven_fields(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    code, out = _run("inspect", str(path))
    assert code == 0, out
    for label in (
        "weights",
        "optimizer state",
        "rng seeds",
        "data offset",
        "config hash",
        "cluster topology",
        "commit sha",
        "deadbeef",
        "ds-abc123",
    ):
        assert label in out, label


def test_diff_names_differing_tensors_and_fields(tmp_path: Path) -> None:
    a = make_state(step=5)
    b = make_state(step=5)
    b.model = dict(b.model)
    b.model["w32"] = b.model["w32"].clone()
    b.model["w32"][0, 0] += 1
    b.data = {**b.data, "cursor": 1}
    pa, pb = save_checkpoint(tmp_path / "a", a), save_checkpoint(tmp_path / "b", b)
    code, out = _run("diff", str(pa), str(pb))
    assert code == 1
    assert "weights differs: w32 (values)" in out and "field data: differs" in out
    assert "weights bitwise equal: no" in out and "optimizer state bitwise equal: yes" in out
    code, out = _run("diff", str(pa), str(save_checkpoint(tmp_path / "c", make_state(step=5))))
    assert code == 0 and "weights bitwise equal: yes" in out


def test_diff_reports_a_dtype_change(tmp_path: Path) -> None:
    a, b = make_state(extra=False), make_state(extra=False)
    b.model = {**b.model, "0.bias": b.model["0.bias"].to(torch.float64)}
    code, out = _run(
        "diff", str(save_checkpoint(tmp_path / "a", a)), str(save_checkpoint(tmp_path / "b", b))
    )
    assert code == 1 and "torch.float32 [16] vs torch.float64 [16]" in out


def test_a_mistyped_checkpoint_path_is_said_not_to_exist_not_to_be_corrupt(
    tmp_path: Path,
) -> None:
    for command in (["inspect"], ["verify"], ["hash"], ["diff", str(tmp_path)]):
        code, out = _run(*command[:1], str(tmp_path / "step-00000001O"), *command[1:])
        assert code == 2 and "does not exist" in out and "corrupt" not in out, (command, out)
