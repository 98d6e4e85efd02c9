from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from perdure.cli import main
from tests.unit.test_data_support import write_corpus


def _build(tmp_path: Path, *extra: str) -> tuple[Path, str]:
    src = write_corpus(tmp_path / "src")
    out = tmp_path / "ds"
    r = CliRunner().invoke(main, ["data", "build", str(src), "--out", str(out), "--seq-len",
                                  "31", "--part-mb", "0.001", *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out, r.output


def test_build_prints_the_version_id_and_inspect_shows_it(tmp_path: Path) -> None:
    out, printed = _build(tmp_path)
    vid = printed.split("version id: ")[1].strip()
    r = CliRunner().invoke(main, ["data", "inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["version_id"] == vid and info["tokens"] == info["samples"] * 32
    r = CliRunner().invoke(main, ["data", "inspect", str(out)])
    assert r.exit_code == 0 and "version id" in r.output


def test_verify_passes_a_good_dataset_and_names_a_bad_part(tmp_path: Path) -> None:
    out, _ = _build(tmp_path)
    r = CliRunner().invoke(main, ["data", "verify", str(out)])
    assert r.exit_code == 0 and "ok" in r.output
    f = out / "shard-00002.bin"
    data = bytearray(f.read_bytes())
    data[10] ^= 0x40
    f.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["data", "verify", str(out)])
    assert r.exit_code == 1
    assert "shard-00002.bin" in r.output and "checksum mismatch" in r.output


def test_build_into_an_existing_dir_fails_without_force(tmp_path: Path) -> None:
    out, _ = _build(tmp_path)
    r = CliRunner().invoke(main, ["data", "build", str(tmp_path / "src"), "--out", str(out)])
    assert r.exit_code == 1 and "already exists" in r.output
    r = CliRunner().invoke(main, ["data", "build", str(tmp_path / "src"), "--out", str(out),
                                  "--force", "--max-mb", "0.001"])  # fmt: skip
    assert r.exit_code == 0, r.output


def test_inspect_of_a_non_dataset_names_the_missing_manifest(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["data", "inspect", str(tmp_path)])
    assert r.exit_code == 1 and "manifest.json: missing" in r.output
