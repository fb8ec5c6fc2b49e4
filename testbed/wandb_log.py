"""Reading a W&B run back from its directory (offline mode): the records of its ``run-<id>.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version) and then
LevelDB-log framing (32 KiB blocks; each chunk a 7-byte header: CRC32, length, type FULL/FIRST/
MIDDLE/LAST) around serialized ``wandb_internal_pb2.Record`` messages. W&B 0.31 ships no Python
reader for it any more (the Go core writes it), so this is the framing's dozen lines; the messages
are parsed with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: str | Path) -> list:
    """Every ``Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, chunk, out = HEADER, b"", []
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER])
        pos += HEADER
        if kind == 0:  # zero padding to the block's end
            pos += left - HEADER
            continue
        chunk += raw[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def run_contents(run_dir: str | Path) -> tuple[str, dict, list[dict]]:
    """(run id, config {key: value}, history rows) of an offline run directory."""
    (log,) = Path(run_dir).glob("run-*.wandb")
    run_id, config, rows = "", {}, []
    for rec in records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in rec.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
        elif kind == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return run_id, config, rows
