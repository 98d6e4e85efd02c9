"""A dataset file is a *part*; *shard* means an optimizer or parameter shard only. What was
written or spelled before the rename still works: old fault kinds, the simulator's old
failure kind and ``--shard-mb`` are read as the new names with a RenamedWarning (a
DeprecationWarning), and manifests, build journals, quarantine entries and decision-log
entries that list ``shards`` load as ``parts``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from perdure import events as ev
from perdure.chaos.config import ChaosConfig, FaultConfig
from perdure.cli import main
from perdure.config import ConfigError, RenamedWarning, build
from perdure.data import DataError, Dataset
from perdure.data.quarantine import QuarantineEntry
from perdure.sim.config import FailureProcess
from tests.unit.test_data_support import make_dataset, write_corpus


@pytest.mark.parametrize(("old", "new"), [("poison_shard", "poison_part"),
                                          ("corrupt_shard", "corrupt_part")])  # fmt: skip
def test_an_old_fault_kind_in_a_config_file_is_read_as_its_new_name_with_a_warning(
    old: str, new: str
) -> None:
    with pytest.warns(RenamedWarning, match=rf"faults\[0\]\.kind: '{old}' is now called '{new}'"):
        chaos = build(ChaosConfig, {"faults": [{"kind": old, "target": "2", "at_step": 3}]})
    assert chaos.faults == [FaultConfig(kind=new, target="2", at_step=3)]


def test_an_old_fault_kind_given_in_python_is_read_as_its_new_name_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"kind: 'poison_shard' is now called"):
        f = FaultConfig(kind="poison_shard", target="1", at_step=0)
    assert f.kind == "poison_part"


def test_the_new_names_give_no_warning_and_an_unknown_kind_is_still_refused() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FaultConfig(kind="corrupt_part", target="1", at_step=0).kind == "corrupt_part"
    with pytest.raises(ConfigError, match="kind"):
        FaultConfig(kind="poison_shards", target="1", at_step=0)


def test_the_simulators_old_failure_kind_is_read_as_nan_part_with_a_warning() -> None:
    with pytest.warns(RenamedWarning, match=r"kind: 'nan_shard' is now called 'nan_part'"):
        p = build(FailureProcess, {"kind": "nan_shard", "per_day": 0.1})
    assert p == FailureProcess(kind="nan_part", per_day=0.1)


def test_shard_mb_builds_the_same_dataset_as_part_mb_with_a_warning(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    ids = []
    for flag in ("--part-mb", "--shard-mb"):
        out = tmp_path / flag.strip("-")
        args = ["data", "build", str(src), "--out", str(out), "--seq-len", "31", flag, "0.001",
                "--processes", "1"]  # fmt: skip
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        renamed = [str(w.message) for w in seen if issubclass(w.category, RenamedWarning)]
        assert renamed == ([] if flag == "--part-mb" else [
            "--shard-mb is now called --part-mb; the old name will be refused in a later release"
        ])  # fmt: skip
        with Dataset.open(str(out)) as ds:
            ids.append((ds.version_id, ds.num_parts))
    assert ids[0] == ids[1] and ids[0][1] > 1


def test_a_manifest_listing_both_parts_and_shards_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    out, _ = make_dataset(tmp_path)
    data = json.loads((out / "manifest.json").read_text())
    data["shards"] = data["parts"]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"shards: cannot be given with 'parts'"):
        Dataset.open(str(out))


def test_a_quarantine_entry_written_with_shards_loads_as_parts() -> None:
    old = {"step": 4, "shards": [2, 5], "samples": [7], "reason": "non-finite"}
    entry = QuarantineEntry.from_dict(old)
    assert entry == QuarantineEntry(4, (2, 5), (7,), "non-finite")
    assert entry.to_dict() == {"step": 4, "parts": [2, 5], "samples": [7], "reason": "non-finite"}


def test_a_decision_written_with_shards_reads_as_parts() -> None:
    old = {"event": ev.DECISION, "step": 3, "kind": "quarantine", "shards": [1]}
    assert ev.decision_parts(old) == [1]
    assert ev.renamed_decision(old) == {"event": ev.DECISION, "step": 3, "kind": "quarantine",
                                        "parts": [1]}  # fmt: skip
    new = {"step": 3, "parts": [0, 2]}
    assert ev.decision_parts(new) == [0, 2] and ev.renamed_decision(new) is new
