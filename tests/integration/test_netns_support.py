"""The emulated hosts themselves: own addresses, a cut path, a pulled cable, cleanup."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.netns_support import PREFIX, Hosts, hosts

_PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], 9), timeout=1)\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def _dial(hs: Hosts, i: int, j: int) -> str:
    """What host i meets dialling a closed port on host j (refused = reachable)."""
    cmd = ["ip", "netns", "exec", hs[i].netns, "python3", "-c", _PROBE, hs[j].address]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()


def test_a_cut_path_between_two_hosts_leaves_every_other_path_up_until_healed() -> None:
    with hosts(3) as hs:
        names = [h.netns for h in hs.hosts]
        assert all(h.address.startswith(f"{PREFIX}.") for h in hs.hosts)
        assert _dial(hs, 0, 1) == "ConnectionRefusedError"  # reachable, nothing listens
        hs.cut(0, 1)
        assert _dial(hs, 0, 1) == "PermissionError"  # prohibited route
        assert _dial(hs, 1, 0) == "PermissionError"
        assert _dial(hs, 0, 2) == _dial(hs, 1, 2) == "ConnectionRefusedError"
        hs.heal(0, 1)
        assert _dial(hs, 0, 1) == "ConnectionRefusedError"
        hs.link_down(2)
        assert _dial(hs, 0, 2) == "TimeoutError"
        hs.link_up(2)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)  # torn down


def test_listening_sockets_are_read_from_the_hosts_own_table() -> None:
    with hosts(1) as hs:
        server = hs.start(
            0,
            ["python3", "-c", f"import socket,time; s=socket.create_server(('{hs[0].address}', "
             "4321)); time.sleep(30)"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            log=Path("/dev/null"),
        )  # fmt: skip
        for _ in range(100):
            if hs.listeners(0):
                break
            time.sleep(0.05)
        assert hs.listeners(0) == [f"{hs[0].address}:4321"]
        server.kill()
