"""Writers of the formats ``perdure data import --format`` reads, from their own libraries
(no tests here): megatron-core's ``IndexedDatasetBuilder`` and mosaicml-streaming's
``MDSWriter`` (pinned in requirements-nodeps.txt, installed --no-deps).

mosaicml-streaming's package ``__init__`` imports torchvision and its whole dataset stack,
which are not installed (they would replace the CPU torch); the writer itself needs only
its codecs. So :func:`mds_writer` registers the three package modules as empty namespace
packages over the installed directories and imports ``streaming.base.format.mds.writer``
itself: the library's real writer code, without its package's import side effects.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np


def write_megatron(prefix: Path, docs: list[np.ndarray], dtype: type) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        half = max(1, doc.size // 2)  # two sequences a document, as sentence splitting gives
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [half, doc.size - half])
    builder.finalize(str(prefix) + ".idx")


def mds_writer() -> Any:
    if "streaming.base.format.mds.writer" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        assert spec is not None and spec.origin is not None
        site = os.path.dirname(spec.origin)
        for name, sub in (("streaming", ""), ("streaming.base", "base"),
                          ("streaming.base.format", "base/format")):  # fmt: skip
            if name not in sys.modules:
                mod = types.ModuleType(name)
                mod.__path__ = [os.path.join(site, sub)]
                sys.modules[name] = mod
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


def write_mds(root: Path, docs: list[np.ndarray], encoding: str, **kw: Any) -> None:
    writer = mds_writer()
    with writer(out=str(root), columns={"id": "int", "tokens": encoding}, **kw) as w:
        for i, doc in enumerate(docs):
            w.write({"id": i, "tokens": doc})
