"""A task module that records every process that imports it (one pid a line in the file
named by ``PERDURE_TEST_IMPORT_LOG``): the zygote's preload is seen as the zygote's pid,
and a worker forked from it must never appear."""

from __future__ import annotations

import os

from examples.tiny_lm.task import make_task

_LOG = os.environ.get("PERDURE_TEST_IMPORT_LOG")
if _LOG:
    with open(_LOG, "a") as f:
        f.write(f"{os.getpid()}\n")
print("import_probe_task: imported")  # on the zygote's stdout, which carries its protocol

__all__ = ["make_task"]
