"""Each case of issue 13 (part 2), as a claim: a manifest that lies is refused by the
loader, ``verify`` (library and CLI) and the reference reader, naming the file and the
rule; nothing loads into different state, nothing fails with a raw traceback."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from perdure.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    state_digest,
    verify_checkpoint,
)
from perdure.checkpoint import reference_reader as rr
from perdure.checkpoint.errors import LegacyManifestWarning
from perdure.checkpoint.manifest import SEAL_KEY, seal_line
from perdure.cli import main
from tests.checkpoint_support import make_state, rewrite_manifest, save_split

Edit = Callable[[dict[str, Any]], object]


def _refused_everywhere(path: Path, match: str) -> None:
    """Loader (both ways), verify, ``perdure ckpt verify`` and the reader all refuse."""
    for check in (load_checkpoint, lambda p: load_checkpoint(p, mmap=False), verify_checkpoint):
        with pytest.raises(CorruptCheckpointError, match=match):
            check(path)
    with pytest.raises(rr.ReaderError, match=match):
        rr.Checkpoint(path)
    result = CliRunner().invoke(main, ["ckpt", "verify", str(path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "corrupt:" in result.output and "Traceback" not in result.output


def _reseal_bytes(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Edit the manifest's bytes under its seal, then seal them anew."""
    mpath = path / "manifest.json"
    data = mpath.read_bytes()
    prefix = edit(data[: data.rindex(b' "' + SEAL_KEY.encode())])
    mpath.write_bytes(prefix + seal_line(prefix))


@pytest.fixture
def no_big_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any ``torch.empty`` of a million elements or more (the loader allocates with it)."""
    empty = torch.empty

    def guarded(*size: Any, **kw: Any) -> torch.Tensor:
        t = empty(*size, **kw)
        assert t.numel() < 10**6, f"allocated {tuple(t.shape)}"
        return t

    monkeypatch.setattr(torch, "empty", guarded)


def _split(tmp_path: Path) -> tuple[Path, str]:
    """A two-writer checkpoint and the name of a tensor split across both part files."""
    path = save_split(tmp_path, make_state(step=5), world=2)
    m = json.loads((path / "manifest.json").read_bytes())
    split = [n for n, t in m["tensors"].items() if len(t["chunks"]) == 2]
    assert any(n.startswith("optimizer/") for n in split), split
    return path, next(n for n in split if n.startswith("optimizer/"))


@pytest.mark.parametrize("seal", [True, False], ids=["resealed", "unsealed"])
def test_chunk_rows_edit_is_refused_by_loader_verify_and_reader(tmp_path: Path, seal: bool) -> None:
    """The issue's case: rows [72, 512] -> [0, 440] (same row count, so the header's
    shape still matches): the second chunk would overwrite rows the first one holds."""
    path, name = _split(tmp_path)

    def shift(m: dict[str, Any]) -> None:
        c = m["tensors"][name]["chunks"][1]
        a, b = c["rows"]
        c["rows"] = [0, b - a]

    rewrite_manifest(path, shift, seal=seal)
    _refused_everywhere(path, "manifest.json: " + ("tensor .*chunk 1" if seal else "no valid seal"))


def test_chunks_must_cover_every_row_exactly_once(tmp_path: Path) -> None:
    path, name = _split(tmp_path)
    rewrite_manifest(path, lambda m: m["tensors"][name]["chunks"].pop())
    _refused_everywhere(path, rf"tensor '{name}': chunks cover rows \[0, \d+\), the shape has")


def test_swapped_chunk_keys_of_two_tensors_are_refused(tmp_path: Path) -> None:
    """exp_avg and exp_avg_sq have one dtype and shape: only the key rule tells them apart."""
    path = save_checkpoint(tmp_path, make_state(step=5))
    a, b = "optimizer/state/2/exp_avg", "optimizer/state/2/exp_avg_sq"

    def swap(m: dict[str, Any]) -> None:
        ca, cb = m["tensors"][a]["chunks"][0], m["tensors"][b]["chunks"][0]
        ca["key"], cb["key"] = cb["key"], ca["key"]

    rewrite_manifest(path, swap)
    _refused_everywhere(path, f"tensor '{a}' chunk 0: key '{b}' should be '{a}'")


def test_every_single_digit_change_in_a_manifest_is_refused_or_changes_nothing(
    tmp_path: Path,
) -> None:
    """The issue counted 65 of 1,500 such flips loading changed state. Here: every digit
    of the manifest, changed and resealed (so only the rules stand in the way)."""
    path = save_checkpoint(tmp_path / "a", make_state(step=5, extra=False))
    want = state_digest(*_state(load_checkpoint(path)))
    prefix = (path / "manifest.json").read_bytes()
    prefix = prefix[: prefix.rindex(b' "' + SEAL_KEY.encode())]
    digits = [i for i, c in enumerate(prefix) if 48 <= c <= 57]
    changed = []
    for i in digits:
        new = prefix[:i] + bytes([48 + (prefix[i] - 47) % 10]) + prefix[i + 1 :]
        (path / "manifest.json").write_bytes(new + seal_line(new))
        try:
            got = state_digest(*_state(load_checkpoint(path)))
        except CheckpointError:
            continue
        if got != want:
            changed.append(i)
    assert len(digits) > 200 and not changed


def _state(loaded: Any) -> tuple[Any, Any]:
    return loaded.model, loaded.optimizer


def test_non_utf8_manifest_is_the_formats_error_and_latest_falls_back(tmp_path: Path) -> None:
    older = save_checkpoint(tmp_path, make_state(step=1, extra=False))
    newer = save_checkpoint(tmp_path, make_state(step=2, extra=False))
    _reseal_bytes(newer, lambda data: data[:40] + b"\xff\xfe" + data[40:])
    _refused_everywhere(newer, r"manifest.json: not UTF-8")
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step-000000002.*not UTF-8"):
        assert latest_checkpoint(tmp_path) == older
    with pytest.warns(UserWarning, match="not UTF-8"):
        assert latest_checkpoint(tmp_path, verify=False) == older


@pytest.mark.parametrize("shape", [[1e9], [10**9]], ids=["float", "int"])
@pytest.mark.usefixtures("no_big_allocations")
def test_huge_shape_without_chunks_is_refused_before_allocation(
    tmp_path: Path, shape: list[Any]
) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))

    def huge(m: dict[str, Any]) -> None:
        m["tensors"]["model/0.weight"].update(shape=shape, chunks=[])

    rewrite_manifest(path, huge)
    _refused_everywhere(path, "tensor 'model/0.weight': ")


@pytest.mark.usefixtures("no_big_allocations")
def test_huge_shape_with_a_chunk_is_refused_before_allocation(tmp_path: Path) -> None:
    """A declared tensor larger than its bytes on disk: the header check refuses it."""
    path = save_checkpoint(tmp_path, make_state(step=5))

    def huge(m: dict[str, Any]) -> None:
        m["tensors"]["model/0.bias"]["shape"] = [10**9]
        m["tensors"]["model/0.bias"]["chunks"][0]["rows"] = [0, 10**9]

    rewrite_manifest(path, huge)
    _refused_everywhere(path, r"'model/0.bias' is stored as F32 \[16\], the manifest says F32")


@pytest.mark.parametrize(
    "name",
    ["../outside.json", "ABSOLUTE", "sub/context.json", "context.json\x00", "..", ""],
)
def test_file_names_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    """The issue's case: the reader followed ``../`` and absolute names. Here the outside
    file holds exactly the context's bytes, so its listed size and CRC match."""
    path = save_checkpoint(tmp_path, make_state(step=5))
    outside = tmp_path / "outside.json"
    outside.write_bytes((path / "context.json").read_bytes())
    name = str(outside) if name == "ABSOLUTE" else name

    def elsewhere(m: dict[str, Any]) -> None:
        m["files"][name] = m["files"].pop("context.json")
        m["context"] = name

    rewrite_manifest(path, elsewhere)
    _refused_everywhere(path, "is not a plain file name")


def test_a_chunk_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    (part,) = path.glob("*.safetensors")
    outside = tmp_path / part.name
    outside.write_bytes(part.read_bytes())

    def elsewhere(m: dict[str, Any]) -> None:
        m["files"][str(outside)] = m["files"].pop(part.name)
        for t in m["tensors"].values():
            for c in t["chunks"]:
                c["file"] = str(outside)

    rewrite_manifest(path, elsewhere)
    _refused_everywhere(path, "is not a plain file name")


def test_a_manifest_dtype_other_than_the_headers_is_refused(tmp_path: Path) -> None:
    """The issue's case: the reader read F32 bytes as I32 when the manifest said so."""
    path = save_checkpoint(tmp_path, make_state(step=5))
    rewrite_manifest(path, lambda m: m["tensors"]["model/0.weight"].update(dtype="I32"))
    _refused_everywhere(path, r"'model/0.weight' is stored as F32 \[16, 8\], the manifest says I32")


def test_missing_rows_are_refused_not_filled_with_garbage(tmp_path: Path) -> None:
    """The issue's case: the reader filled rows no chunk covers with ``np.empty``."""
    path, name = _split(tmp_path)

    def gap(m: dict[str, Any]) -> None:
        c = m["tensors"][name]["chunks"][1]
        c["rows"][0] += 1
        c["key"] = f"{name}[{c['rows'][0]}:{c['rows'][1]}]"

    rewrite_manifest(path, gap)
    _refused_everywhere(path, rf"tensor '{name}' chunk 1: rows \[\d+, \d+\) start at")


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"step": 5,', "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"step": 5, "step": 5}', "not valid JSON .key .step. appears twice"),
    ],
    ids=["not-utf8", "not-json", "not-object", "duplicate-key"],
)
def test_a_context_that_is_not_utf8_json_is_the_formats_error(
    tmp_path: Path, bad: bytes, rule: str
) -> None:
    """Even when its listed size and CRC match (the checksum is no excuse to skip it)."""
    path = save_checkpoint(tmp_path, make_state(step=5))
    (path / "context.json").write_bytes(bad)
    rec = {"bytes": len(bad), "checksum": f"crc32:{zlib.crc32(bad):08x}"}
    rewrite_manifest(path, lambda m: m["files"].__setitem__("context.json", rec))
    _refused_everywhere(path, f"context.json: {rule}")


def test_a_context_step_other_than_the_manifests_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    ctx = json.loads((path / "context.json").read_bytes())
    ctx["step"] = 6
    data = json.dumps(ctx).encode()
    (path / "context.json").write_bytes(data)
    rec = {"bytes": len(data), "checksum": f"crc32:{zlib.crc32(data):08x}"}
    rewrite_manifest(path, lambda m: m["files"].__setitem__("context.json", rec))
    _refused_everywhere(path, "context.json: step 6 disagrees with the manifest's 5")


def test_a_manifest_step_other_than_the_directory_name_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    rewrite_manifest(path, lambda m: m.__setitem__("step", 6))
    _refused_everywhere(path, r"step 6 disagrees with the directory name")


def test_a_hand_edit_under_the_seal_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    mpath = path / "manifest.json"
    mpath.write_bytes(mpath.read_bytes().replace(b'"step": 5', b'"step":  5'))
    _refused_everywhere(path, "manifest.json: checksum mismatch")


def test_a_listed_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    (path / "context.json").unlink()
    os.mkfifo(path / "context.json")
    _refused_everywhere(path, "context.json: not a regular file")


def _legacy(path: Path, edit: Edit | None = None) -> None:
    """Make ``path`` look written by a format 1.0 writer (no seal), optionally edited."""

    def to_v10(m: dict[str, Any]) -> None:
        m["version"] = {"major": 1, "minor": 0}
        if edit is not None:
            edit(m)

    rewrite_manifest(path, to_v10, seal=False)


def test_a_format_10_checkpoint_loads_identically_with_a_clear_note(tmp_path: Path) -> None:
    state = make_state(step=5)
    path = save_checkpoint(tmp_path, state)
    _legacy(path)
    with pytest.warns(LegacyManifestWarning, match="format 1.0 manifest without a checksum"):
        loaded = load_checkpoint(path)
    assert state_digest(loaded.model, loaded.optimizer) == state_digest(
        state.model, state.optimizer
    )
    with pytest.warns(rr.LegacyManifestWarning):
        assert not rr.Checkpoint(path).sealed
    result = CliRunner().invoke(main, ["ckpt", "verify", str(path)])
    assert result.exit_code == 0, result.output
    assert "note:" in result.output and "manifest unsealed (format 1.0)" in result.output


def test_a_format_10_checkpoint_still_obeys_every_structural_rule(tmp_path: Path) -> None:
    path, name = _split(tmp_path)

    def shift(m: dict[str, Any]) -> None:
        c = m["tensors"][name]["chunks"][1]
        c["rows"] = [0, c["rows"][1] - c["rows"][0]]

    _legacy(path, shift)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyManifestWarning)
        warnings.simplefilter("ignore", rr.LegacyManifestWarning)
        _refused_everywhere(path, f"tensor '{name}' chunk 1")


def test_a_format_11_manifest_without_its_seal_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    rewrite_manifest(path, lambda m: None, seal=False)
    _refused_everywhere(path, "manifest.json: no valid seal")


def test_the_writer_seals_every_manifest_and_it_stays_plain_json(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=5))
    m = json.loads((path / "manifest.json").read_bytes())
    assert m["version"] == {"major": 1, "minor": 1}
    assert m[SEAL_KEY].startswith("sha256:") and list(m)[-1] == SEAL_KEY
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rr.Checkpoint(path).sealed
        load_checkpoint(path)


def test_the_reference_reader_and_the_library_share_the_specs_numbers() -> None:
    """The reader stands alone (it copies the spec's numbers); they must not drift."""
    from perdure.checkpoint import layout, manifest, sfile

    assert rr._SIZE == layout.DTYPE_SIZES and rr.MAX_COUNT == layout.MAX_COUNT
    assert rr._SEAL_BYTES == manifest.SEAL_BYTES == 98
    assert rr.MAX_MANIFEST == manifest.MAX_MANIFEST and rr.MAX_HEADER == sfile.MAX_HEADER
    assert rr.SEALED_SINCE_MINOR == layout.SEALED_SINCE_MINOR and rr.MAJOR == layout.FORMAT_MAJOR
