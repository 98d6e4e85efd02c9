"""Config of the data loader. The dataset's content is pinned by its version id, not here."""

from __future__ import annotations

from dataclasses import dataclass, field

from perdure.config import MATH_ADDED, Checker


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
    document_fields: bool = field(default=False, metadata=MATH_ADDED)
    """Hand the task ``doc_ids`` and ``position_ids`` beside ``tokens`` (each sample's
    document of every token and its position in it, for intra-document attention), from
    the document boundaries a Megatron or MDS import keeps (``docs/data.md``). A dataset
    without boundaries is refused at start-up, naming it. What the task sees, so part of
    the math (left out of the config hash when off: runs before it hash as they did)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(bool(self.dataset), "dataset", "must not be empty", self.dataset)
        c.positive("cache_mb", self.cache_mb)
        c.non_negative("prefetch_steps", self.prefetch_steps)
        c.done()
