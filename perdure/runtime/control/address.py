"""Where the coordinator listens and what its peers dial: decided here, once.

Every listener of a coordinator (the control channel, the run's store, and any other
listener a later module adds, such as a metrics endpoint) binds :attr:`Endpoints.bind`
and nothing else; :attr:`Endpoints.advertise` is what workers and the standby dial and
what the ports file and the events publish. The CLI flags (``--host``, ``--advertise``,
``--channel-port``, ``--store-port``) override the cluster config's fields in
:func:`coordinator_endpoints`, the one function that decides them.

The data plane's address (a worker's gloo or NCCL listener) is chosen on the worker's
side (``runtime/worker.py``): ``--host`` or ``--interface``, or by default its own address
on the path to the coordinator. The helpers below map between interface names and their
IPv4 addresses (Linux ``ioctl``), so either can be given.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

from perdure.runtime.config import ClusterConfig

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Endpoints:
    """The coordinator's addresses and ports (0: a free port, chosen at bind time)."""

    bind: str
    """The address every listener of the coordinator binds (never another one)."""
    advertise: str
    """The address peers dial (the bind address unless told otherwise)."""
    channel_port: int
    store_port: int


def host_port(host: str, port: int | str) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets (``[::1]:29500``): the form every
    ``--coordinator`` and ``--primary`` flag, and ``entry.parse_address``, read."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def coordinator_endpoints(
    cluster: ClusterConfig,
    *,
    host: str | None = None,
    advertise: str | None = None,
    channel_port: int | None = None,
    store_port: int | None = None,
) -> Endpoints:
    """The coordinator's endpoints: the flags where given, else the cluster config.

    Raises ValueError naming the flag when the result cannot work: a wildcard bind
    address (``0.0.0.0``, ``::``) without an address to advertise."""
    bind = host if host is not None else cluster.host
    adv = advertise if advertise is not None else cluster.advertise
    if adv is None:
        if is_wildcard(bind):
            raise ValueError(
                f"--host {bind} listens on every interface: give --advertise ADDRESS "
                "(what workers dial), or better, --host with this machine's own address"
            )
        adv = bind
    return Endpoints(
        bind=bind,
        advertise=adv,
        channel_port=cluster.channel_port if channel_port is None else channel_port,
        store_port=cluster.port if store_port is None else store_port,
    )


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a name counts as what it resolves to)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``; ValueError naming it if it has
    none (or does not exist)."""
    if name not in {n for _, n in socket.if_nameindex()}:
        names = sorted(n for _, n in socket.if_nameindex())
        raise ValueError(f"--interface {name!r}: no such network interface (have {names})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise ValueError(f"--interface {name!r}: the interface has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (None: no interface of this host
    does, or it is not an IPv4 address)."""
    for _, name in socket.if_nameindex():
        with contextlib.suppress(ValueError):
            if interface_address(name) == address:
                return name
    return None


__all__ = [
    "Endpoints",
    "coordinator_endpoints",
    "interface_address",
    "interface_of",
    "is_loopback",
    "is_wildcard",
]
