"""A dataset without a ``tokens`` field (issue 36 item 4): images and labels import from a
.npy or .npz pair, each field is served bitwise in its own dtype and shape, the importer's
errors name the field, the manifest is validated, and a CNN trains on it with the same
final weights on one worker and on two."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from perdure.cli import main
from perdure.data import DataError, Dataset, SlotLoader
from perdure.data.fields import Field
from perdure.data.importer import import_arrays
from perdure.events import read_jsonl
from perdure.launch.preflight import PreflightError, preflight
from perdure.runtime.replica.slots import to_tensors
from tests.image_task import digits
from tests.runtime_support import run_to_end, small_config

N = 640
STEPS = 12


@pytest.fixture(scope="module")
def arrays(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    images, labels = digits(N)
    np.save(root / "images.npy", images)
    np.save(root / "labels.npy", labels)
    np.savez(root / "digits.npz", images=images, labels=labels)
    return root


@pytest.fixture(scope="module")
def image_dataset(arrays: Path) -> Path:
    """Imported through the CLI, as a user would, into parts of about 100 samples."""
    out = arrays / "ds"
    r = CliRunner().invoke(main, [
        "data", "import", "--out", str(out), "--part-mb", str(100 * 72 / (1 << 20)),
        "--field", f"images={arrays / 'images.npy'}", "--field", f"labels={arrays / 'labels.npy'}",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"{N} samples (images: uint8 [8, 8], labels: int64 []) in 7 parts" in r.output
    assert "vocabulary" not in r.output
    return out


def test_images_and_labels_import_with_no_tokens_field(image_dataset: Path) -> None:
    data = json.loads((image_dataset / "manifest.json").read_text())
    assert data["format_version"] == 2 and data["seq_len"] is None and data["num_tokens"] == 0
    assert data["sample"] == {
        "byte_order": "little",
        "fields": [
            {"name": "images", "dtype": "uint8", "shape": [8, 8]},
            {"name": "labels", "dtype": "int64", "shape": []},
        ],
        "row_bytes": 72,
    }
    assert data["build"] == {"samples_per_shard": 100}  # its old name: it enters the id
    with Dataset.open(str(image_dataset)) as ds:
        m = ds.manifest
        assert not m.tokens and m.fields == (
            Field("images", "uint8", (8, 8)),
            Field("labels", "int64", ()),
        )
        with pytest.raises(DataError, match="holds no 'tokens' field"):
            ds.read(np.arange(2))


def test_each_field_reaches_the_task_bitwise_in_its_dtype_and_shape(
    arrays: Path, image_dataset: Path
) -> None:
    images, labels = np.load(arrays / "images.npy"), np.load(arrays / "labels.npy")
    with Dataset.open(str(image_dataset)) as ds, SlotLoader(ds, seed=3, global_batch=16,
                                                            slots=4) as ld:  # fmt: skip
        b = ld.batch(5, 2)
        t = to_tensors(b)
    assert b.tokens is None and set(t) == {"images", "labels", "weight"}
    assert t["images"].dtype == torch.int64 and tuple(t["images"].shape) == (4, 8, 8)
    assert np.array_equal(t["images"].numpy(), images[b.sample_ids])
    assert np.array_equal(t["labels"].numpy(), labels[b.sample_ids])


def test_an_npz_pair_is_the_same_dataset_as_the_npy_pair(
    arrays: Path, image_dataset: Path, tmp_path: Path
) -> None:
    z = str(arrays / "digits.npz")
    m = import_arrays({"images": [z], "labels": [z]}, str(tmp_path / "z"),
                      part_mb=100 * 72 / (1 << 20))  # fmt: skip
    with Dataset.open(str(image_dataset)) as ds:
        assert m.version_id == ds.version_id


def test_fields_that_do_not_fit_are_refused_naming_the_field(arrays: Path, tmp_path: Path) -> None:
    images = str(arrays / "images.npy")
    np.save(tmp_path / "short.npy", np.zeros(N - 1, np.int64))
    np.savez(tmp_path / "two.npz", a=np.zeros(N), b=np.zeros(N))
    cases = [
        ({"labels": [str(tmp_path / "short.npy")]}, {},
         f"field 'labels' has {N - 1} values, 'images' {N} samples"),
        ({"labels": [str(tmp_path / "two.npz")]}, {},
         r"two\.npz: holds no array 'labels' \(it has \['a', 'b'\]"),
        ({"labels": [str(arrays / "labels.npy")]}, {"vocab_size": 10},
         "describe tokens; the fields"),
    ]  # fmt: skip
    for extra, kw, message in cases:
        with pytest.raises(DataError, match=message):
            import_arrays({"images": [images], **extra}, str(tmp_path / "ds"), **kw)
        assert not (tmp_path / "ds").exists()


def test_a_field_of_the_wrong_sample_count_is_refused_naming_both(
    arrays: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "few.npy", np.zeros((N - 2, 4), np.float32))
    with pytest.raises(DataError, match=f"field 'extra' has {N - 2} samples, 'images' {N}"):
        import_arrays({"images": [str(arrays / "images.npy")],
                       "extra": [str(tmp_path / "few.npy")]}, str(tmp_path / "ds"))  # fmt: skip


def test_a_manifest_without_tokens_must_say_seq_len_null(
    image_dataset: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(image_dataset, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["seq_len"] = 8
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match="seq_len: must be null without a 'tokens' field"):
        Dataset.open(str(copy))


def _config(ds: Path, workers: int, **task: Any) -> Any:
    entry = {"entry": "tests.image_task:make_task", "options": {}, **task}
    optim = {"lr": 0.02, "warmup_steps": 1}
    return small_config(ds, workers=workers, steps=STEPS, batch=32, slots=8, task=entry,
                        optim=optim)  # fmt: skip


@pytest.fixture(scope="module")
def reference(image_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("images-ref")
    return {**run_to_end(_config(image_dataset, 1), run_dir), "run_dir": run_dir}


def test_a_cnn_trains_on_images_and_labels_and_the_loss_falls(reference: dict) -> None:
    assert reference["steps"] == STEPS and reference["final_hash"].startswith("sha256:")
    metrics = list(read_jsonl(reference["run_dir"] / "metrics.jsonl"))
    losses = [m["loss"] for m in metrics]
    assert len(losses) == STEPS and all(m["tokens_per_s"] is None for m in metrics)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


def test_two_workers_end_bitwise_equal_to_one_on_images_and_labels(
    reference: dict, image_dataset: Path, tmp_path: Path
) -> None:
    two = run_to_end(_config(image_dataset, 2), tmp_path)
    assert two["steps"] == STEPS and two["final_hash"] == reference["final_hash"]


def test_preflight_refuses_a_token_model_on_a_dataset_without_tokens(
    image_dataset: Path,
) -> None:
    cfg = small_config(image_dataset, workers=1, steps=STEPS)  # tiny_lm: max_len, vocab
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    rules = [p.rule for p in info.value.problems if p.key == "data.dataset"]
    assert any("declares vocab_size and max_len (it reads tokens) but the dataset has no "
               "'tokens' field, only ['images', 'labels']" in r for r in rules), rules  # fmt: skip
