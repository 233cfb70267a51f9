"""The history rows an offline W&B run logged, read back from its run-<id>.wandb file. The wandb package no
longer ships a Python reader (its core is a Go binary), but the file is a LevelDB-style log of protobuf
Records: a 7-byte W&B header, then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type)."""

import json
import struct

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _LAST = 1, 4


def _records(path: str) -> list[wandb_internal_pb2.Record]:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        pending += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(path: str) -> list[dict[str, object]]:
    """One dict per logged step, W&B's own keys (_step, _runtime, ...) included."""
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in _records(path)
        if record.WhichOneof("record_type") == "history"
    ]


def summary(path: str) -> dict[str, object]:
    """The run's summary as its records updated it (later updates win)."""
    out: dict[str, object] = {}
    for record in _records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def exit_codes(path: str) -> list[int]:
    """The exit codes the run recorded when it was finished (none while it is still open)."""
    return [record.exit.exit_code for record in _records(path) if record.WhichOneof("record_type") == "exit"]
