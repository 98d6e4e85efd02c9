from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime_support import build_small_dataset


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_small_dataset(tmp_path_factory.mktemp("data") / "stdlib-small")
