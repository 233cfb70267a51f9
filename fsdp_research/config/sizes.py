"""Sizes as people write them: `500MB`, `5GB` (powers of 10), `80GiB`, `81920MiB`, `80G` (powers of 2, as
SLURM's --mem and nvidia-smi mean G), or a bare number in the caller's unit. Imports only the errors."""

import re

from fsdp_research.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text, key: str, fix: str, unit: int = 1) -> int:
    """Bytes; a bare number counts in `unit` (bytes by default). ConfigError(key, ..., fix) when unreadable."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|[KMG]|B)?\s*", str(text).upper())
    if not match:
        raise ConfigError(key, f"cannot read {text!r}", fix)
    scale = _UNITS[match.group(2)] if match.group(2) else unit
    return int(float(match.group(1)) * scale)


def export_shard_size(text) -> int:
    """checkpoint.export_shard_size in bytes."""
    return parse_size(text, "checkpoint.export_shard_size", "use bytes, or e.g. 500MB, 5GB")
