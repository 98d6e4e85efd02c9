"""Named crash points of the writer, for the tests that kill a save half-way.

Setting ``PERDURE_CKPT_CRASH_AT=<point>`` makes the writing process SIGKILL itself when it
reaches that point, exactly as a power cut or an OOM kill would stop it. Points, in order:
``before_write``, ``during_write`` (a part file's header is written, its data is not),
``before_manifest`` (all parts durable), ``after_manifest`` (manifest durable inside the
temporary directory, which is not yet renamed), ``after_rename`` (committed; before the
parent directory's fsync and retention). Unset in production; the check is one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "PERDURE_CKPT_CRASH_AT"
POINTS = ("before_write", "during_write", "before_manifest", "after_manifest", "after_rename")


def crash_point(name: str) -> None:
    assert name in POINTS, name
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
