"""Safetensors files consolidated into the Hugging Face layout without loading a tensor: their headers are read and
each tensor's bytes copied into shards of at most a given size (model.safetensors, or
model-0000i-of-0000N.safetensors with model.safetensors.index.json), the shards shared out between the processes
that write them. What lets an export be written in parallel: each rank writes its own files, then its share of
the shards."""

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

INDEX = "model.safetensors.index.json"
# Bytes per element of safetensors' dtypes: tensors go in order of it, largest first (as safetensors writes them),
# so that every tensor starts at a multiple of its element size.
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_COPY = 64 * 2**20


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: its header entry and where its bytes are."""

    name: str
    file: str
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_tensors(path: str) -> tuple[list[Tensor], dict[str, str]]:
    """The tensors of a safetensors file (in the order of their bytes) and its metadata, from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    metadata = header.pop("__metadata__", None) or {}
    tensors = [
        Tensor(
            name,
            path,
            8 + size + e["data_offsets"][0],
            e["data_offsets"][1] - e["data_offsets"][0],
            e["dtype"],
            tuple(e["shape"]),
        )  # fmt: skip
        for name, e in header.items()
    ]
    return sorted(tensors, key=lambda t: t.start), metadata


def plan_shards(tensors: Sequence[Tensor], shard_size: int) -> list[list[Tensor]]:
    """The tensors, in order, in consecutive shards of at most shard_size bytes (a larger tensor alone)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """save_pretrained's file names for count shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shard(tensors: Sequence[Tensor], path: str, metadata: dict[str, str]) -> None:
    """One safetensors file of the tensors, their bytes copied from where they are (written whole: temp + rename)."""
    ordered = sorted(tensors, key=lambda t: (-_ITEMSIZE.get(t.dtype, 1), t.name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in ordered:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-aligned, as safetensors writes it
    with open(path + ".tmp", "wb") as out:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for t in ordered:
            with open(t.file, "rb") as f:
                f.seek(t.start)
                left = t.nbytes
                while left:
                    chunk = f.read(min(left, _COPY))
                    out.write(chunk)
                    left -= len(chunk)
    os.replace(path + ".tmp", path)


def write_index(shards: Sequence[Sequence[Tensor]], out_dir: str) -> None:
    """model.safetensors.index.json where there are several shards, as save_pretrained writes it."""
    if len(shards) < 2:
        return
    names = shard_names(len(shards))
    index = {
        "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
        "weight_map": {t.name: name for shard, name in zip(shards, names) for t in shard},
    }
    with open(os.path.join(out_dir, INDEX), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def consolidate(
    files: Sequence[str], out_dir: str, shard_size: int, rank: int = 0, world: int = 1
) -> list[list[Tensor]]:
    """Write the shards of the files' tensors (in the files' order) that fall to this rank (shard i: rank
    i % world); returns every shard's tensors (the same on every rank)."""
    tensors, metadata = [], {}
    for path in files:
        found, metadata = read_tensors(path)
        tensors += found
    shards = plan_shards(tensors, shard_size)
    for i, (shard, name) in enumerate(zip(shards, shard_names(len(shards)))):
        if i % world == rank:
            write_shard(shard, os.path.join(out_dir, name), metadata)
    return shards
