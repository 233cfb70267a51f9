"""What a source is, and how it is cut into parts that workers tokenize independently: whole files of a format
grouped up to a part's size, and big files of a splittable format (uncompressed JSON Lines, Parquet, saved and hub
datasets) split into ranges, in a fixed order: the parts' documents, concatenated in order, are the source's
documents whoever reads them. Imports nothing heavier than numpy: tokenization workers start from here."""

import glob
import json
import os
import stat
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_research.data.formats import SPLITTABLE, compression, dataset_size, file_format, read, row_groups
from fsdp_research.errors import ConfigError

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


# A source's files (and saved datasets' directories), sorted, each with the one stat taken of it.
Files = dict[str, os.stat_result]


def _matches(patterns: Sequence[str]) -> list[str]:
    hits = (glob.glob(os.path.expanduser(pattern), recursive=True) for pattern in patterns)
    return sorted({os.path.abspath(path) for paths in hits for path in paths})


def _no_file(patterns: Sequence[str], key: str) -> ConfigError:
    return ConfigError(key, f"{list(patterns)} matches no file", f"point {key} at existing files or globs")


def _is_source(path: str, st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) or (stat.S_ISDIR(st.st_mode) and file_format(path, is_dir=True) == "saved")


def scan(patterns: Sequence[str], key: str) -> Files:
    """The files (and saved-dataset directories) that paths and globs name, with one stat each; ConfigError if
    none. A corpus of many small files (code) opens its store at the cost of this listing."""
    found = {}
    for path in _matches(patterns):
        try:
            st = os.stat(path)
        except OSError:  # a broken link, or a file gone since the listing
            continue
        if _is_source(path, st):
            found[path] = st
    if not found:
        raise _no_file(patterns, key)
    return found


def resolve_files(patterns: Sequence[str], key: str) -> list[str]:
    """The files (and saved-dataset directories) that paths and globs name, sorted; ConfigError if none."""
    return list(scan(patterns, key))


def first_file(patterns: Sequence[str], key: str) -> str:
    """The first of resolve_files(), found with a stat of as few paths as it takes (the config's check)."""
    for path in _matches(patterns):
        try:
            if _is_source(path, os.stat(path)):
                return path
        except OSError:
            continue
    raise _no_file(patterns, key)


def _members(path: str, st: os.stat_result) -> list[tuple[str, os.stat_result]]:
    """A file itself, or every file of a saved dataset's directory."""
    if not stat.S_ISDIR(st.st_mode):
        return [(path, st)]
    members = [(m, os.stat(m)) for m in sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))]
    return [(m, m_st) for m, m_st in members if stat.S_ISREG(m_st.st_mode)]


def identity(files: Files) -> list[list[Any]]:
    """What names the sources' content for the store's key: each file's path, size and modification time (every
    file of a saved dataset's directory), from scan()'s stats."""
    return [[m, m_st.st_size, m_st.st_mtime_ns] for path, st in files.items() for m, m_st in _members(path, st)]


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


def plan_parts(scanned: Files, text_field: str) -> list[Part]:
    """The parts of a source, in document order: consecutive files of a whole-file format grouped up to the part
    size, a file of a splittable format (uncompressed JSON Lines, Parquet, saved datasets) split into ranges. Only
    where a store is built (a Parquet file's footer is read here)."""
    files = list(scanned)
    sizes = [sum(m_st.st_size for _, m_st in _members(path, st)) for path, st in scanned.items()]
    formats = [file_format(path, is_dir=stat.S_ISDIR(st.st_mode)) for path, st in scanned.items()]
    limit = part_bytes(sum(sizes))
    parts: list[Part] = []
    run: list[int] = []  # consecutive whole-file files of one format, not yet in parts

    def flush() -> None:
        for a, b in _sized_ranges([sizes[i] for i in run], limit):
            parts.append(Part(tuple(files[i] for i in run[a:b]), formats[run[a]], text_field))
        run.clear()

    for i, path in enumerate(files):
        fmt = formats[i]
        if fmt in SPLITTABLE and not compression(path):
            flush()
            parts += _split(path, fmt, text_field, limit)
        else:
            if run and formats[run[-1]] != fmt:
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


def probe(first: str, text_field: str) -> None:
    """Read the first record of a source's first file where that is cheap: a wrong text field or a file of
    another format fails here, before anything is tokenized."""
    fmt = file_format(first)
    if fmt in ("jsonl", "csv", "parquet", "saved"):
        next(iter(read(fmt, first, text_field, 0, None if fmt in ("jsonl", "csv") else 1)), None)


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
