"""What a source is, and how it is cut into parts that workers tokenize independently: whole files of a format
grouped up to a part's size, and big files of a splittable format (uncompressed JSON Lines, Parquet, saved and hub
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

# The bounds of a part's size (see part_bytes).
MIN_PART_BYTES, MAX_PART_BYTES = 4 * 2**20, 256 * 2**20
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


def part_bytes(total: int) -> int:
    """How large parts are for a source of `total` bytes: about 256 of them (several for every core of a job),
    within [MIN_PART_BYTES, MAX_PART_BYTES]. A function of the sizes alone, so an interrupted build resumes with
    the same parts."""
    return min(max(total // 256, MIN_PART_BYTES), MAX_PART_BYTES)


def _sized_ranges(sizes: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose sizes add up to about `limit` each."""
    ranges, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total and total + size > limit:
            ranges.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        ranges.append((start, len(sizes)))
    return ranges


def _split(path: str, fmt: str, text_field: str, limit: int) -> list[Part]:
    """The parts of one file of a splittable format."""
    if fmt == "jsonl":
        size = os.path.getsize(path)
        return [Part((path,), fmt, text_field, a, min(a + limit, size)) for a in range(0, size, limit)]
    if fmt == "parquet":
        return [Part((path,), fmt, text_field, a, b) for a, b in _sized_ranges(row_groups(path), limit)]
    return _row_parts((path,), fmt, text_field, *dataset_size(fmt, path), limit)


def _row_parts(files: tuple[str, ...], fmt: str, text_field: str, rows: int, nbytes: int, limit: int) -> list[Part]:
    per_part = max(1, limit * rows // max(nbytes, 1))
    return [Part(files, fmt, text_field, a, min(a + per_part, rows)) for a in range(0, rows, per_part)] or [
        Part(files, fmt, text_field, 0, 0)
    ]


def plan_parts(files: Sequence[str], text_field: str) -> list[Part]:
    """The parts of a source, in document order: consecutive files of a whole-file format grouped up to the part
    size, a file of a splittable format (uncompressed JSON Lines, Parquet, saved datasets) split into ranges."""
    sizes = [sum(size for _, size, _ in identity([f])) for f in files]
    limit = part_bytes(sum(sizes))
    parts: list[Part] = []
    run: list[int] = []  # consecutive whole-file files of one format, not yet in parts

    def flush() -> None:
        for a, b in _sized_ranges([sizes[i] for i in run], limit):
            parts.append(Part(tuple(files[i] for i in run[a:b]), file_format(files[run[a]]), text_field))
        run.clear()

    for i, path in enumerate(files):
        fmt = file_format(path)
        if fmt in SPLITTABLE and not compression(path):
            flush()
            parts += _split(path, fmt, text_field, limit)
        else:
            if run and file_format(files[run[-1]]) != fmt:
                flush()
            run.append(i)
    flush()
    return parts


def hub_parts(spec: dict[str, Any], text_field: str) -> list[Part]:
    """The parts of a hub dataset (load_dataset's arguments in spec): row ranges, or one part of the first
    max_documents when streaming."""
    files = (json.dumps(spec, sort_keys=True),)
    if spec["streaming"]:
        return [Part(files, "hub", text_field)]
    rows, nbytes = dataset_size("hub", files[0])
    return _row_parts(files, "hub", text_field, rows, nbytes, part_bytes(nbytes))


def probe(files: Sequence[str], text_field: str) -> None:
    """Read the first record of the first file where that is cheap: a wrong text field or a file of another
    format fails here, before anything is tokenized."""
    fmt = file_format(files[0])
    if fmt in ("jsonl", "csv", "parquet", "saved"):
        next(iter(read(fmt, files[0], text_field, 0, None if fmt in ("jsonl", "csv") else 1)), None)


def read_part(part: Part) -> Iterator[Any]:
    """The part's texts in order, as its readers yield them (see formats); batches() makes batches of them."""
    if part.stop is not None:  # a range of one file or dataset
        return read(part.format, part.files[0], part.text_field, part.start, part.stop)
    return (text for source in part.files for text in read(part.format, source, part.text_field))


def batches(texts: Iterator[Any]) -> Iterator[Any]:
    """Documents to tokenize, empty and null texts left out: lists of about BATCH_BYTES of text, or Arrow string
    arrays as columnar readers yield them."""
    batch: list[str] = []
    size = 0
    for text in texts:
        if isinstance(text, str):
            if text:
                batch.append(text)
                size += len(text)
                if size >= BATCH_BYTES:
                    yield batch
                    batch, size = [], 0
        elif text is not None:  # an Arrow string array
            import pyarrow.compute as pc

            if batch:
                yield batch
                batch, size = [], 0
            text = text.filter(pc.fill_null(pc.greater(pc.binary_length(text), 0), False))
            if len(text):
                yield text
    if batch:
        yield batch


def text_bytes(batch: Any) -> int:
    """How much text a batch holds, in UTF-8 bytes (a list of str, or an Arrow string array)."""
    if isinstance(batch, list):
        return sum(len(t.encode("utf-8")) for t in batch)
    import pyarrow.compute as pc

    return pc.sum(pc.binary_length(batch)).as_py() or 0
