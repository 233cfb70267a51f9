"""What a source is, and how it is cut into parts that workers tokenize independently: whole files of a format
grouped up to PART_BYTES, and big files of a splittable format (uncompressed JSON Lines, Parquet, saved and hub
datasets) split into ranges, in a fixed order: the parts' documents, concatenated in order, are the source's
documents whoever reads them. Imports nothing heavier than numpy: tokenization workers start from here."""

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .formats import SPLITTABLE, compression, dataset_size, file_format, read, row_groups

# Parts are about this large: small enough for every core of a node to get several, large enough that a worker's
# start-up is noise. Fixed, so that an interrupted build is resumed with the same parts.
PART_BYTES = 32 * 2**20
# A batch of documents handed to the tokenizer at once.
BATCH_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Part:
    """What one worker tokenizes: whole files (in order), or a range of one: bytes [start, stop) of an
    uncompressed JSON Lines file (the lines that start in it), row groups of a Parquet file, rows of a saved or
    hub dataset. For the hub, files holds the load_dataset arguments as JSON."""

    files: tuple[str, ...]
    format: str
    text_field: str
    start: int = 0
    stop: int | None = None


def default_paths() -> list[str]:
    """With no data.paths: the running Python's standard-library sources (offline, on every machine)."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "*.py")]


def resolve_files(patterns: Sequence[str], key: str) -> list[str]:
    """The files (and saved-dataset directories) that paths and globs name, sorted; ConfigError if none."""
    found = set()
    for pattern in patterns:
        for path in glob.glob(os.path.expanduser(pattern), recursive=True):
            if os.path.isfile(path) or (os.path.isdir(path) and file_format(path) == "saved"):
                found.add(os.path.abspath(path))
    if not found:
        raise ConfigError(key, f"{list(patterns)} matches no file", f"point {key} at existing files or globs")
    return sorted(found)


def identity(files: Sequence[str]) -> list[list[Any]]:
    """What names the sources' content for the store's key: each file's path, size and modification time (every
    file of a saved dataset's directory)."""
    out = []
    for path in files:
        members = sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True)) if os.path.isdir(path) else [path]
        for member in members:
            if os.path.isfile(member):
                stat = os.stat(member)
                out.append([member, stat.st_size, stat.st_mtime_ns])
    return out


def _sized_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive index ranges whose sizes add up to about PART_BYTES each."""
    ranges, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total and total + size > PART_BYTES:
            ranges.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def _split(path: str, fmt: str, text_field: str) -> list[Part]:
    """The parts of one big file of a splittable format."""
    if fmt == "jsonl":
        size = os.path.getsize(path)
        return [Part((path,), fmt, text_field, a, min(a + PART_BYTES, size)) for a in range(0, size, PART_BYTES)]
    if fmt == "parquet":
        return [Part((path,), fmt, text_field, a, b) for a, b in _sized_ranges(row_groups(path))]
    return _row_parts((path,), fmt, text_field, *dataset_size(fmt, path))


def _row_parts(files: tuple[str, ...], fmt: str, text_field: str, rows: int, nbytes: int) -> list[Part]:
    per_part = max(1, PART_BYTES * rows // max(nbytes, 1))
    return [Part(files, fmt, text_field, a, min(a + per_part, rows)) for a in range(0, rows, per_part)] or [
        Part(files, fmt, text_field, 0, 0)
    ]


def plan_parts(files: Sequence[str], text_field: str) -> list[Part]:
    """The parts of a source, in document order: files of whole-file formats grouped up to PART_BYTES, a big file
    of a splittable format (uncompressed JSON Lines, Parquet, saved datasets) split into ranges."""
    parts: list[Part] = []
    group: list[str] = []
    for path in files:
        fmt = file_format(path)
        if fmt in SPLITTABLE and not compression(path):
            parts += [Part((g,), file_format(g), text_field) for g in group]
            group = []
            parts += _split(path, fmt, text_field)
        else:
            group.append(path)
    # Whole-file formats: consecutive files of one format in parts of about PART_BYTES.
    by_run: list[list[str]] = []
    for path in group:
        if by_run and file_format(by_run[-1][-1]) == file_format(path):
            by_run[-1].append(path)
        else:
            by_run.append([path])
    for run in by_run:
        for a, b in _sized_ranges([os.path.getsize(p) for p in run]):
            parts.append(Part(tuple(run[a:b]), file_format(run[a]), text_field))
    return parts


def hub_parts(spec: dict[str, Any], text_field: str) -> list[Part]:
    """The parts of a hub dataset (load_dataset's arguments in spec): row ranges, or one part of the first
    max_documents when streaming."""
    files = (json.dumps(spec, sort_keys=True),)
    if spec["streaming"]:
        return [Part(files, "hub", text_field)]
    return _row_parts(files, "hub", text_field, *dataset_size("hub", files[0]))


def probe(files: Sequence[str], text_field: str) -> None:
    """Read the first record of the first file where that is cheap: a wrong text field or a file of another
    format fails here, before anything is tokenized."""
    fmt = file_format(files[0])
    if fmt in ("jsonl", "csv", "parquet", "saved"):
        next(iter(read(fmt, files[0], text_field, 0, None if fmt in ("jsonl", "csv") else 1)), None)


def read_part(part: Part) -> Iterator[str]:
    """The part's documents, in order (empty and null texts skipped)."""
    if part.stop is not None:  # a range of one file or dataset
        texts = read(part.format, part.files[0], part.text_field, part.start, part.stop)
    else:
        texts = (text for source in part.files for text in read(part.format, source, part.text_field))
    return (text for text in texts if text)


def batches(texts: Iterator[str]) -> Iterator[list[str]]:
    """Documents in batches of about BATCH_BYTES of text."""
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
