"""Process titles: what ``ps``, ``top`` and ``/proc/<pid>/cmdline`` show for each process.

Without them every worker forked from the zygote reads ``python -m perdure.launch.zygote``
and every process of a run looks alike: an operator cannot tell which pid to look at
(or to ``kill``). Each process names its role, and once it knows them its worker name and
run: ``perdure worker eu_west-1 (run mine)``, ``perdure spare spare-0 (run mine)``,
``perdure coordinator (run mine)``, ``perdure standby (run mine)``, ``perdure zygote
(run mine)``; a launcher's base zygote (``launch/zygote_base.py``), which serves all its
runs, is ``perdure zygote-base``. The run is named by its run directory's last part.

Uses ``setproctitle`` (it rewrites the process's argv area, so ``/proc/<pid>/cmdline``
changes too, and sets the kernel's short ``comm`` name). Limits: without ``setproctitle``
installed, titles are left as they are (a run is not refused for a cosmetic); the kernel
truncates ``comm`` to 15 bytes, so ``top``'s short view shows the start of the title.
"""

from __future__ import annotations

from pathlib import PurePath

ROLES = ("worker", "spare", "coordinator", "standby", "zygote", "zygote-base")
"""The roles a title may name."""


def title(role: str, name: str | None = None, run_dir: str | None = None) -> str:
    """The title of a process of ``role`` (one of ``ROLES``), e.g. ``perdure worker
    eu_west-1 (run mine)``. Pure."""
    assert role in ROLES, role
    parts = ["perdure", role]
    if name:
        parts.append(name)
    text = " ".join(parts)
    run = run_name(run_dir) if run_dir else ""
    return f"{text} (run {run})" if run else text


def run_name(run_dir: str) -> str:
    """A run's name: the last part of its run directory (``runs/mine`` -> ``mine``)."""
    return PurePath(run_dir.rstrip("/")).name


def set_title(role: str, name: str | None = None, run_dir: str | None = None) -> str | None:
    """Set this process's title (see :func:`title`); returns it, or None when
    ``setproctitle`` is not installed."""
    try:
        import setproctitle
    except ImportError:
        return None
    text = title(role, name, run_dir)
    setproctitle.setproctitle(text)
    return text
