"""The ``etcd`` lease backend: the run's lease as a key attached to an etcd lease.

Talks to etcd's v3 JSON gateway (``POST /v3/kv/txn``, ``/v3/lease/grant`` ...) with
``urllib``, so the HA backend adds no dependency: the Python etcd clients are gRPC
bindings with their own protobuf and grpcio pins (and the best known, ``etcd3``, is
unmaintained), while the gateway is part of every etcd server since 3.3 (tested here with
Debian's ``etcd-server`` 3.4.23). Limits: plain HTTP or HTTPS with the system's CA store;
no client certificates and no etcd user authentication (add them before exposing etcd
beyond a trusted network).

Keys, under ``<cluster.etcd_prefix>/<run id>/`` (the run id is a hash of the run token, so
every process of a run finds the same keys without another setting, and the token is not
revealed):

- ``generation``: the newest generation granted (a decimal string);
- ``leader``: the holder's record, attached to its etcd lease: etcd deletes it when the
  holder stops renewing, which is what "expired" means here;
- ``holder``: the same record, not attached to the lease: who held it last, so that a
  standby can probe the primary's channel after etcd removed ``leader``;
- ``ended``: the generation the run finished under.

Taking the lease is one transaction: ``generation`` still what the caller saw and
``leader`` absent, then write both. Renewal is a keep-alive; a holder whose etcd lease
expired while nobody took over takes the key again under the same generation.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from perdure.runtime.control.lease import SAFETY, Granted, LeaseStoreError, LeaseView, Lost


def run_id(token: str) -> str:
    """The run's key under the prefix: a hash of its token."""
    return hashlib.sha256(b"perdure-lease:" + token.encode()).hexdigest()[:16]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class EtcdError(LeaseStoreError):
    """etcd answered with an error (its message), or no endpoint answered."""


class Etcd:
    """A minimal client of the v3 JSON gateway: each call tries the endpoints in order,
    each within ``timeout_s``."""

    def __init__(self, endpoints: list[str], timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("cluster.etcd_endpoints must name at least one endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        for base in self.endpoints:
            req = urllib.request.Request(
                base + path, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return _first_object(resp.read())
            except urllib.error.HTTPError as e:
                answer = _first_object(e.read() or b"{}")
                raise EtcdError(f"etcd {base}{path}: {answer.get('message', e)}") from None
            except (OSError, ValueError) as e:  # refused, timed out, not JSON: try the next
                errors.append(f"{base}: {e}")
        raise EtcdError(f"no etcd endpoint answered {path}: {'; '.join(errors)}")

    def range_prefix(self, prefix: str) -> dict[str, dict[str, Any]]:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        out = self.post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return {_unb64(kv["key"]): kv for kv in out.get("kvs", [])}

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> bool:
        out = self.post("/v3/kv/txn", {"compare": compare, "success": success})
        return bool(out.get("succeeded", False))

    def grant(self, ttl_s: int) -> tuple[str, int]:
        out = self.post("/v3/lease/grant", {"TTL": ttl_s})
        if out.get("error"):
            raise EtcdError(f"etcd lease grant: {out['error']}")
        return str(out["ID"]), int(out["TTL"])

    def keepalive(self, lease: str) -> int:
        """The lease's remaining TTL after the keep-alive; 0 when it expired."""
        out = self.post("/v3/lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", 0))

    def revoke(self, lease: str) -> None:
        with contextlib.suppress(EtcdError):  # gone already, or unreachable: it expires
            self.post("/v3/lease/revoke", {"ID": lease})


def _first_object(data: bytes) -> dict[str, Any]:
    """The first JSON object of a gateway answer (a keep-alive may stream several)."""
    line = data.strip().split(b"\n", 1)[0] if data.strip() else b"{}"
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"etcd answered {obj!r}, not a JSON object")
    return obj


class EtcdLease:
    """The run's lease in etcd (see module doc); a :class:`~lease.LeaseStore`."""

    def __init__(
        self,
        endpoints: list[str],
        prefix: str,
        token: str,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.etcd = Etcd(endpoints, timeout_s=max(0.2, min(2.0, ttl_s / 4)))
        self.base = f"{prefix.rstrip('/')}/{run_id(token)}/"
        self.ttl_s = float(math.ceil(ttl_s))  # etcd's TTLs are whole seconds
        self.clock = clock
        self.lease: str | None = None
        self.holder: dict[str, Any] = {}

    @property
    def _gen_key(self) -> str:
        return self.base + "generation"

    @property
    def _leader_key(self) -> str:
        return self.base + "leader"

    @property
    def _holder_key(self) -> str:
        return self.base + "holder"

    @property
    def _ended_key(self) -> str:
        return self.base + "ended"

    def observe(self) -> LeaseView:
        kvs = self.etcd.range_prefix(self.base)
        gen = int(_unb64(kvs[self._gen_key]["value"])) if self._gen_key in kvs else 0
        ended = int(_unb64(kvs[self._ended_key]["value"])) if self._ended_key in kvs else 0
        leader = kvs.get(self._leader_key)
        last = leader or kvs.get(self._holder_key)
        holder: dict[str, Any] = json.loads(_unb64(last["value"])) if last else {}
        state = "none" if gen == 0 else "ended" if ended >= gen and not leader else "held"
        version = int(leader["create_revision"]) if leader else 0
        return LeaseView(gen, version, state, leader is not None, holder)

    def acquire(self, expect: LeaseView, floor: int, holder: dict[str, Any]) -> Granted | Lost:
        generation = max(expect.generation, floor) + 1
        took = self._take(expect.generation, generation, holder)
        return took if took is not None else Lost(self.observe())

    def renew(self, generation: int) -> Granted | Lost:
        t0 = self.clock()
        if self.lease is not None:
            ttl = self.etcd.keepalive(self.lease)
            if ttl > 0:
                return Granted(generation, t0 + SAFETY * ttl)
            self.lease = None
        # Our etcd lease expired: take the key again if nobody took over meanwhile.
        took = self._take(generation, generation, self.holder)
        return took if took is not None else Lost(self.observe())

    def end(self, generation: int) -> None:
        self.etcd.txn(
            [_value_is(self._gen_key, generation)],
            [
                {"request_put": {"key": _b64(self._ended_key), "value": _b64(str(generation))}},
                {"request_delete_range": {"key": _b64(self._leader_key)}},
            ],
        )
        if self.lease is not None:
            self.etcd.revoke(self.lease)
            self.lease = None

    def close(self) -> None:
        pass  # the lease is left to expire: a coordinator that stops does not hand over

    def _take(self, seen: int, generation: int, holder: dict[str, Any]) -> Granted | None:
        """One transaction: ``generation`` key still ``seen`` and no leader, then write
        ``generation`` and the leader key under a fresh etcd lease."""
        t0 = self.clock()
        lease, ttl = self.etcd.grant(int(self.ttl_s))
        record = json.dumps({**holder, "generation": generation})
        ok = self.etcd.txn(
            [_value_is(self._gen_key, seen), _absent(self._leader_key)],
            [
                {"request_put": {"key": _b64(self._gen_key), "value": _b64(str(generation))}},
                {
                    "request_put": {
                        "key": _b64(self._leader_key),
                        "value": _b64(record),
                        "lease": lease,
                    }
                },
                {"request_put": {"key": _b64(self._holder_key), "value": _b64(record)}},
                {"request_delete_range": {"key": _b64(self._ended_key)}},
            ],
        )
        if not ok:
            self.etcd.revoke(lease)
            return None
        self.lease, self.holder = lease, holder
        return Granted(generation, t0 + SAFETY * ttl)


def _value_is(key: str, generation: int) -> dict[str, Any]:
    if generation == 0:
        return {"key": _b64(key), "result": "EQUAL", "target": "VERSION", "version": "0"}
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(str(generation))}


def _absent(key: str) -> dict[str, Any]:
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}


__all__ = ["Etcd", "EtcdError", "EtcdLease", "run_id"]
