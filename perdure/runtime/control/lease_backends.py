"""Which store holds the run's lease: the embedded file (``lease.py``) or etcd
(``etcd.py``), as ``cluster.ha_backend`` says. Its own module, above both backends: the
etcd backend builds on the lease's types, so the choice between them cannot live beside
those types without an import circle."""

from __future__ import annotations

from pathlib import Path

from perdure.runtime.control.etcd import EtcdLease
from perdure.runtime.control.lease import FileLease, LeaseStore


def open_lease_store(
    backend: str,
    *,
    run_dir: str | Path,
    ttl_s: float,
    token: str,
    etcd_endpoints: list[str],
    etcd_prefix: str,
) -> LeaseStore:
    """The run's lease in the configured backend (``cluster.ha_backend``)."""
    if backend == "embedded":
        return FileLease(run_dir, ttl_s)
    if backend == "etcd":
        return EtcdLease(etcd_endpoints, etcd_prefix, token, ttl_s)
    raise ValueError(f"cluster.ha_backend must be 'embedded' or 'etcd' (got {backend!r})")
