"""Config of the data loader. The dataset's content is pinned by its version id, not here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from perdure.config import MATH_ADDED, Checker


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where the dataset lives and how it is streamed."""

    dataset: str = "runs/datasets/stdlib"
    """Directory or fsspec URL of a dataset built by ``perdure data build`` (holds
    ``manifest.json``). A relative path is resolved against ``run.base_dir``: the config
    file's directory for a TOML file (or its ``[run] base_dir``), the working directory
    for a config built in code."""
    cache_dir: str | None = None
    """Local cache for remote parts; default: a ``cache/`` folder in the run directory."""
    cache_mb: int = 1024
    """Size bound of the local part cache; least recently used parts are evicted."""
    prefetch_steps: int = 1
    """Steps of samples read ahead in the background (0 disables prefetch)."""
    document_fields: bool = field(default=False, metadata=MATH_ADDED)
    """Hand the task ``doc_ids`` and ``position_ids`` beside ``tokens`` (each sample's
    document of every token and its position in it, for intra-document attention), from
    the document boundaries a Megatron or MDS import keeps (``docs/data.md``). A dataset
    without boundaries is refused at start-up, naming it. What the task sees, so part of
    the math (left out of the config hash when off: runs before it hash as they did)."""

    mirrors: list[str] = field(default_factory=list)
    """Copies of the dataset (directories or fsspec URLs holding the same part files, e.g.
    another bucket or region), tried in order when a part fails its checksum twice or
    cannot be read: each copy is checked against the manifest's SHA-256 before it is
    served, so a repaired run trains on the same bits (a ``part_repaired`` event names
    the part, the mirror and both checksums). Never written to."""
    on_corrupt: Literal["stop", "quarantine"] = "stop"
    """What a part with no good copy (corrupt or unreadable after a re-read and every
    mirror) does: ``stop`` ends the run before any sample of it is trained on, naming the
    part file, both checksums and ``perdure data verify``; ``quarantine`` leaves the
    part out from that step on, a decision-log entry of kind ``corrupt`` (it changes the
    math, as any quarantine does, and is replayed on resume)."""
    read_timeout_s: float = 30.0
    """Deadline of one request to remote storage (a part's download, the manifest): a
    request that stalls longer is abandoned and tried again. Local files have none."""
    read_attempts: int = 6
    """Tries of one remote request (errors and stalls past ``read_timeout_s``), with
    exponential backoff between them (0.2 s doubling, at most 5 s); a part still
    unreadable after them is repaired from ``mirrors`` or handled by ``on_corrupt``."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(bool(self.dataset), "dataset", "must not be empty", self.dataset)
        c.positive("cache_mb", self.cache_mb)
        c.non_negative("prefetch_steps", self.prefetch_steps)
        for i, m in enumerate(self.mirrors):
            c.check(isinstance(m, str) and bool(m), f"mirrors[{i}]", "must be a non-empty "
                    "directory or fsspec URL", m)  # fmt: skip
        c.check(self.dataset not in self.mirrors, "mirrors", "must not hold data.dataset "
                "itself (a mirror is another copy)", self.dataset)  # fmt: skip
        c.one_of("on_corrupt", self.on_corrupt, ("stop", "quarantine"))
        c.positive("read_timeout_s", self.read_timeout_s)
        c.check(isinstance(self.read_attempts, int) and self.read_attempts >= 1,
                "read_attempts", "must be an integer >= 1", self.read_attempts)  # fmt: skip
        c.done()
