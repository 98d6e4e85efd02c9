"""The event log's names live in one module (perdure/events.py), shared by writers and readers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import perdure
from perdure import events as ev
from perdure.events import JsonLines, read_jsonl

PKG = Path(perdure.__file__).parent
_LITERAL = re.compile(r'"(' + "|".join(sorted(ev.NAMES)) + r')"')


def test_no_module_but_events_spells_an_event_name() -> None:
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "events.py":
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r'"event"\]? *[:=!]=? *"', code):
                hits.append(f"{path.relative_to(PKG)}:{no}: {line.strip()}")
    assert hits == []


def test_every_name_constant_is_in_names_and_unique() -> None:
    consts = {k: v for k, v in vars(ev).items() if k.isupper() and isinstance(v, str)}
    assert set(consts.values()) == set(ev.NAMES)
    assert len(consts) == len(ev.NAMES)
    assert all(v == k.lower() for k, v in consts.items())


def test_writer_refuses_an_unknown_event_name(tmp_path: Path) -> None:
    log = JsonLines(tmp_path / "events.jsonl")
    log.write({"event": ev.JOIN, "worker": "a"})
    with pytest.raises(AssertionError):
        log.write({"event": "joined", "worker": "a"})
    assert [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")] == [ev.JOIN]
