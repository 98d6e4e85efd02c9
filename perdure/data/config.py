"""Config of the data loader. The dataset's content is pinned by its version id, not here."""

from __future__ import annotations

from dataclasses import dataclass

from perdure.config import Checker


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the dataset lives and how it is streamed."""

    dataset: str = "runs/datasets/stdlib"
    """Directory or fsspec URL of a dataset built by ``perdure data build`` (holds
    ``manifest.json``). Relative paths are resolved against the working directory."""
    cache_dir: str | None = None
    """Local cache for remote shards; default: a ``cache/`` folder in the run directory."""
    cache_mb: int = 1024
    """Size bound of the local shard cache; least recently used shards are evicted."""
    prefetch_steps: int = 1
    """Steps of samples read ahead in the background (0 disables prefetch)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(bool(self.dataset), "dataset", "must not be empty", self.dataset)
        c.positive("cache_mb", self.cache_mb)
        c.non_negative("prefetch_steps", self.prefetch_steps)
        c.done()
