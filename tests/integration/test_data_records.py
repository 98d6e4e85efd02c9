"""Text records in (``perdure data build --text-field``): the same records in any container
give byte-identical parts and version ids; bad records are named or counted; the parts do
not depend on the process count; an interrupted build, killed with a real signal, resumes
to the same bytes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import perdure.data.build as build_mod
from perdure.data import DataError, build_dataset
from perdure.lifecycle import running
from tests.proc_support import descendants
from tests.records_support import stdlib_records, train_bpe, write_all

BPE = "perdure.data.hf:tokenizer_json"


def _parts(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "manifest.json"}


def _expected_bytes(records: list[dict], seq_len: int) -> np.ndarray:
    stream = b"".join(r["text"].encode() + b"\0" for r in records)
    arr = np.frombuffer(stream, dtype=np.uint8)
    return arr[: arr.size // (seq_len + 1) * (seq_len + 1)]


@pytest.fixture(scope="module")
def containers(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict[str, Path]]:
    records = stdlib_records()
    return records, write_all(tmp_path_factory.mktemp("records"), records)


def test_five_containers_of_the_same_records_build_byte_identical_parts(
    containers: tuple[list[dict], dict[str, Path]], tmp_path: Path
) -> None:
    records, paths = containers
    built = {}
    for kind, src in paths.items():
        m = build_dataset([str(src)], str(tmp_path / kind), text_field="text", seq_len=63,
                          part_mb=0.05)  # fmt: skip
        built[kind] = (m.version_id, _parts(tmp_path / kind))
        assert m.sources["documents"] == len(records)
    first = built["jsonl"]
    assert len(first[1]) > 2
    for kind, got in built.items():
        assert got == first, kind
    stream = np.concatenate([np.frombuffer(b, np.uint8) for b in first[1].values()])
    assert np.array_equal(stream, _expected_bytes(records, 63))


def test_the_same_records_with_a_bpe_tokenizer_agree_across_containers(
    containers: tuple[list[dict], dict[str, Path]], tmp_path: Path
) -> None:
    records, paths = containers
    tok = train_bpe(records, tmp_path / "tok.json")
    ids = set()
    for kind in ("zst", "parquet", "hf"):
        m = build_dataset([str(paths[kind])], str(tmp_path / kind), text_field="text",
                          tokenizer=BPE, tokenizer_file=str(tok), seq_len=31)  # fmt: skip
        ids.add(m.version_id)
        assert m.dtype == "uint16" and m.build["separator"] == 0  # <|endoftext|> is id 0
    assert len(ids) == 1


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "rule"),
    [
        ({"body": "x"}, "row 2 \\(line 3\\): field 'text' is missing"),
        ({"text": 7}, "row 2 \\(line 3\\): field 'text' is int, not a string"),
        ({"text": None}, "row 2 \\(line 3\\): field 'text' is null, not a string"),
        ("{not json", "row 2 \\(line 3\\): field 'text' cannot be read: the line is not JSON"),
    ],
)
def test_a_bad_record_is_an_error_naming_file_row_and_field(
    tmp_path: Path, row: object, rule: str
) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "a" * 40}, {"text": "b" * 40}, row])
    with pytest.raises(DataError, match=f"in.jsonl: {rule}"):
        build_dataset([str(src)], str(tmp_path / "o"), text_field="text", seq_len=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_bad_records_in_parquet_and_datasets_are_named_too(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a" * 40, None, "c"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n.parquet: row 1: field 'text' is null"):
        build_dataset([str(tmp_path / "n.parquet")], str(tmp_path / "o"), text_field="text")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "i.parquet")
    with pytest.raises(DataError, match=r"i.parquet: row 0: field 'text' is int64, not a string"):
        build_dataset([str(tmp_path / "i.parquet")], str(tmp_path / "o"), text_field="text")
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"hf: row 0: field 'text' is missing"):
        build_dataset([str(tmp_path / "hf")], str(tmp_path / "o"), text_field="text")


def test_skipped_bad_records_are_counted_in_the_manifest(tmp_path: Path) -> None:
    good = [{"text": "x" * 30}, {"text": "y" * 30}]
    src = _jsonl(tmp_path / "in.jsonl", [good[0], {"text": 3}, "[1]", good[1], {"no": 1}])
    m = build_dataset([str(src)], str(tmp_path / "o"), text_field="text", seq_len=7,
                      skip_bad_records=True)  # fmt: skip
    skipped = m.sources["skipped_records"]
    assert skipped["count"] == 3 and m.sources["documents"] == 2
    assert [s["row"] for s in skipped["first"]] == [1, 2, 4]
    ref = build_dataset([str(_jsonl(tmp_path / "good.jsonl", good))], str(tmp_path / "r"),
                        text_field="text", seq_len=7)  # fmt: skip
    assert ref.version_id == m.version_id


def test_one_and_two_processes_give_byte_identical_parts(
    containers: tuple[list[dict], dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_mod, "CHUNK_BYTES", 8192)  # many chunks
    records, paths = containers
    tok = train_bpe(records, tmp_path / "tok.json")
    got = []
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        m = build_dataset([str(paths["parquet"])], str(out), text_field="text", tokenizer=BPE,
                          tokenizer_file=str(tok), seq_len=31, part_mb=0.02,
                          processes=n)  # fmt: skip
        got.append((m.version_id, _parts(out)))
    assert len(got[0][1]) > 2
    assert got[0] == got[1]


def test_files_as_documents_are_the_same_on_two_processes(tmp_path: Path) -> None:
    from tests.unit.test_data_support import write_corpus

    src = write_corpus(tmp_path / "src", files=30)
    one = build_dataset([str(src)], str(tmp_path / "a"), seq_len=15, part_mb=0.01)
    two = build_dataset([str(src)], str(tmp_path / "b"), seq_len=15, part_mb=0.01, processes=2)
    assert one.version_id == two.version_id
    assert _parts(tmp_path / "a") == _parts(tmp_path / "b")


DRIVER = """
import sys
import perdure.data.build as b
b.CHUNK_BYTES = 2048
b.build_dataset([sys.argv[1]], sys.argv[2], text_field="text", seq_len=31, part_mb=0.01,
                tokenizer="tests.tokenizer_support:slow_bytes", processes=int(sys.argv[3]),
                resume=sys.argv[4] == "1")
"""


def _driver(src: Path, out: Path, procs: int, resume: bool) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(src), str(out), str(procs),
                             "1" if resume else "0"], cwd=Path(__file__).parents[2])  # fmt: skip


@pytest.mark.parametrize("procs", [1, 2])
def test_a_killed_build_resumed_gives_the_same_bytes(
    containers: tuple[list[dict], dict[str, Path]], tmp_path: Path, procs: int
) -> None:
    records, paths = containers
    src = paths["jsonl"]
    ref = _driver(src, tmp_path / "ref", procs, False)
    assert ref.wait(timeout=120) == 0
    out = tmp_path / "out"
    state = tmp_path / ".out.partial" / "state.json"
    proc = _driver(src, out, procs, False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if state.exists() and json.loads(state.read_text())["sink"]["parts"]:
            break
        time.sleep(0.02)
    workers = descendants(proc.pid)
    assert len(workers) >= procs - 1  # the pool's processes (and its resource tracker)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    _all_end(workers)  # the pool ends with its builder (were left blocked on its queue)
    done = json.loads(state.read_text())
    assert 0 < done["records"] < len(records) and not out.exists()
    resumed = _driver(src, out, procs, True)
    assert resumed.wait(timeout=120) == 0
    assert _parts(out) == _parts(tmp_path / "ref")
    assert (
        json.loads((out / "manifest.json").read_text())["version_id"]
        == json.loads((tmp_path / "ref" / "manifest.json").read_text())["version_id"]
    )
    assert not (tmp_path / ".out.partial").exists()


def _all_end(pids: set[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in pids if running(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes outlived their killed builder: {sorted(left)}"


def test_resume_refuses_changed_sources(tmp_path: Path) -> None:
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "x" * 300}] * 20)
    work = tmp_path / ".o.partial"
    work.mkdir()
    (work / "state.json").write_text(json.dumps({"fingerprint": "sha256:other", "records": 3}))
    with pytest.raises(DataError, match="made from other sources or parameters"):
        build_dataset([str(src)], str(tmp_path / "o"), text_field="text", resume=True)


def test_the_cli_builds_records_on_two_processes_and_reports_them(
    containers: tuple[list[dict], dict[str, Path]], tmp_path: Path
) -> None:
    _, paths = containers
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "perdure", "data", "build", str(paths["zst"]), "--out",
           str(out), "--text-field", "text", "--processes", "2", "--seq-len", "63"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "records of 1 files" in res.stdout and "on 2 processes" in res.stdout
    flags = [str(paths["zst"]), "--out", str(tmp_path / "x"), "--skip-bad-records"]
    bad = subprocess.run([*cmd[:5], *flags], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--skip-bad-records: needs --text-field" in bad.stderr
