"""A task factory that fails in a worker and nowhere else (a worker has the run token in
its environment; the launcher and its preflight do not): what preflight cannot see."""

from __future__ import annotations

import os

from perdure.runtime.entry import TOKEN_ENV
from perdure.runtime.replica.task import Task


def make_task(**options: object) -> Task:
    from examples.tiny_lm.task import make_task as tiny

    if TOKEN_ENV in os.environ:
        raise RuntimeError("this task cannot be built in a worker")
    return tiny(**options)  # type: ignore[arg-type]
