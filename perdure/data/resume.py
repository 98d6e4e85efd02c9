"""The work directory of a build, kept when a build is interrupted, so ``--resume`` goes on.

A build works in ``.<out>.partial/`` beside its output. After every chunk it has consumed it
records, in ``state.json`` (written to a temporary name, then renamed: never half a file),
how far it got: the records consumed, the parts finished (with their checksums), the
tokens not yet in a part (the *pending* file, which the next chunk's ids are appended to;
rewritten under a new name whenever a part is cut) and the statistics. ``--resume`` loads
that state, checks that the sources and parameters are the ones it was made from (a
*fingerprint*: each source's path, size and modification time, and every build parameter),
skips the records already consumed without tokenizing them, and continues: the result is
byte-identical to an uninterrupted build.

What survives: a killed process (Ctrl-C, SIGTERM, SIGKILL, a dead worker). A state newer
than its pending file (a kill between the two writes) cannot happen: the pending data is
written first, the state names its length, and data past that length is ignored. Limit:
files are not fsynced chunk by chunk, so after a power loss ``--resume`` may find a state
whose files the kernel never wrote; it then refuses, naming the file, and the build starts
afresh without ``--resume``.

A build that fails on bad input (a bad record, a bad tokenizer) removes the directory: it
could not be resumed into anything different.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from perdure.data.errors import DataError
from perdure.data.hashing import canonical_hash

STATE = "state.json"


def partial_dir(out: str) -> Path:
    dest = Path(out)
    return dest.parent / f".{dest.name}.partial"


def fingerprint(params: dict[str, Any], paths: list[Path]) -> str:
    """What a resumed build must agree on: the parameters and each source's identity."""
    files = []
    for p in paths:
        st = p.stat()
        files.append([p.resolve().as_posix(), st.st_size, st.st_mtime_ns])
    return canonical_hash({"params": params, "sources": files})


def open_partial(out: str, resume: bool, print_: Any) -> tuple[Path, dict[str, Any] | None]:
    """The work directory and the state to resume from (None: a fresh build)."""
    work = partial_dir(out)
    if work.exists() and not resume:
        shutil.rmtree(work)
        print_(f"removed the work directory of an interrupted build ({work}; pass --resume "
               "to continue one instead)")  # fmt: skip
    state = None
    if resume and (work / STATE).is_file():
        try:
            state = json.loads((work / STATE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"--resume: {work / STATE} cannot be read ({e}); "
                            "build again without --resume") from None  # fmt: skip
    elif resume:
        print_(f"--resume: no interrupted build at {work}; building from the start")
        if work.exists():
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    return work, state


def check_state(state: dict[str, Any], fp: str, work: Path) -> None:
    if state.get("fingerprint") != fp:
        raise DataError(
            f"--resume: the interrupted build in {work} was made from other sources or "
            "parameters (a source file's size or modification time, or a flag, differs); "
            "build again without --resume"
        )


def save_state(work: Path, state: dict[str, Any]) -> None:
    tmp = work / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, work / STATE)


def drop_state(work: Path) -> None:
    (work / STATE).unlink(missing_ok=True)
