"""Reads a W&B offline run file (``run-<id>.wandb``) without W&B's uploader: the file is a
LevelDB-style log (a 7-byte header ``:W&B`` + magic 0xBEE1 + version 0, then 32 KiB
blocks of records, each a 7-byte header, CRC-32C 4 bytes, length 2, type 1: FULL=1,
FIRST=2, MIDDLE=3, LAST=4, a short block tail zero-padded) whose payloads are W&B's
``Record`` protobufs. Only what the tests need: the history rows."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:7] == HEADER, f"{path}: not a W&B run file ({data[:7]!r})"
    out: list[bytes] = []
    pos, partial = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's zero-padded tail
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(body)
        elif kind == 2:
            partial = body
        elif kind == 3:
            partial += body
        elif kind == 4:
            out.append(partial + body)
            partial = b""
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Every logged row (``run.log``), its keys and JSON values decoded."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows
