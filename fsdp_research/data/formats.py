"""How each kind of file is read: plain text (one document per file), JSON Lines and JSON (also .gz and .zst),
Parquet, CSV, Arrow, directories written by `datasets.save_to_disk`, and Hugging Face hub datasets. Every reader
yields its texts in order, one by one (str, or None for a null) or as Arrow string arrays where the format is
columnar (the byte tokenizer then takes the UTF-8 bytes as they are, no Python string made); and names the file and
the line or row it cannot read."""

import csv
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsdp_research.errors import ConfigError

# JSON Lines are parsed this much at a time.
CHUNK_BYTES = 4 * 2**20

_COMPRESSION = (".gz", ".zst")
_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
# Formats whose big files are split into several parts.
SPLITTABLE = ("jsonl", "parquet", "saved", "hub")


def compression(path: str) -> str | None:
    return next((c for c in _COMPRESSION if path.lower().endswith(c)), None)


def file_format(path: str, is_dir: bool | None = None) -> str:
    """The reader a path takes: by its name (a compression suffix aside); a directory is a saved dataset. is_dir:
    what a stat already said (None: look)."""
    if os.path.isdir(path) if is_dir is None else is_dir:
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json")):
            return "saved"
        raise ConfigError(
            "data.paths",
            f"{path} is a directory but not one written by datasets.save_to_disk",
            "point at its files with a glob, e.g. dir/**/*.jsonl",
        )
    name = path.lower()
    suffix = compression(name)
    if suffix:
        name = name[: -len(suffix)]
    return _FORMATS.get(os.path.splitext(name)[1], "text")


def _open_binary(path: str):
    suffix = compression(path)
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _line_number(path: str, offset: int) -> int:
    """The 1-based line of a byte offset (counted only when there is an error to name)."""
    lines, pos = 1, 0
    with _open_binary(path) as f:
        while pos < offset:
            chunk = f.read(min(2**20, offset - pos))
            if not chunk:
                break
            lines, pos = lines + chunk.count(b"\n"), pos + len(chunk)
    return lines


def _bad_file(path: str, where: str, problem: str) -> ConfigError:
    return ConfigError("data.paths", f"{path} {where}: {problem}", "fix or remove that file")


def _text_of(record: Any, field: str, path: str, where: Callable[[], str]) -> str | None:
    """The text of one record; where() names it (called only to say what is wrong)."""
    if not isinstance(record, dict):
        raise _bad_file(path, where(), f"a record must be a JSON object, not {type(record).__name__}")
    if field not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise ConfigError(
            "data.text_field",
            f"{path} {where()} has no field {field!r} (its fields: {fields})",
            "set it to one of them",
        )
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise _bad_file(path, where(), f"field {field!r} holds a {type(value).__name__}, not text")
    return value


def _read_text(path: str, _field: str) -> Iterator[str | None]:
    with _open_binary(path) as f:
        data = f.read()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise _bad_file(path, f"line {line}", "not UTF-8 text") from None


def _jsonl_chunks(path: str, start: int, stop: int | None) -> Iterator[tuple[int, bytes]]:
    """Whole lines, about CHUNK_BYTES at a time, of the lines that start in bytes [start, stop): (the offset of the
    chunk's first line, the chunk)."""
    with _open_binary(path) as f:
        pos = 0
        if start:
            # The line that began before `start` belongs to the part before.
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())
        while stop is None or pos < stop:
            data = f.read(CHUNK_BYTES if stop is None else min(CHUNK_BYTES, stop - pos))
            if not data:
                return
            if not data.endswith(b"\n"):
                data += f.readline()  # the last line started in the range: all of it
            yield pos, data
            pos += len(data)


def _fast_texts(chunk: bytes, field: str):
    """The chunk's texts parsed by Arrow's JSON reader (C++, one thread) as one string array, or None for anything
    it does not take as plain records with a text in `field` (a bad line, a missing field, a null): the line by
    line reader then says what and where, or skips the nulls."""
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        table = pj.read_json(
            io.BytesIO(chunk),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(chunk) + 1),
            parse_options=pj.ParseOptions(
                explicit_schema=pa.schema([(field, pa.string())]), unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowException, ValueError):
        return None
    column = table.column(0)
    return None if column.null_count else column.combine_chunks()


def _read_jsonl(path: str, field: str, start: int = 0, stop: int | None = None) -> Iterator[Any]:
    for offset, chunk in _jsonl_chunks(path, start, stop):
        texts = _fast_texts(chunk, field)
        if texts is None:
            yield from _jsonl_lines(path, chunk, offset, field)
        else:
            yield texts


def _jsonl_lines(path: str, chunk: bytes, offset: int, field: str) -> Iterator[str | None]:
    """Line by line, naming the line of anything wrong."""
    pos = offset
    for line in chunk.split(b"\n"):
        if line.strip():

            def where(at: int = pos) -> str:
                return f"line {_line_number(path, at)}"

            try:
                record = json.loads(line)
            except ValueError as err:
                raise _bad_file(path, where(), f"not JSON ({err})") from None
            yield _text_of(record, field, path, where)
        pos += len(line) + 1


def _read_json(path: str, field: str) -> Iterator[str | None]:
    with _open_binary(path) as f:
        data = f.read()
    if not data.lstrip().startswith(b"["):  # JSON Lines under a .json name, as datasets' json loader allows
        yield from _read_jsonl(path, field)
        return
    try:
        records = json.loads(data)
    except ValueError as err:
        raise _bad_file(path, f"line {getattr(err, 'lineno', '?')}", f"not JSON ({err})") from None
    if not isinstance(records, list):
        raise _bad_file(path, "(the whole file)", "must be a JSON array of records, or JSON Lines")
    for i, record in enumerate(records):
        yield _text_of(record, field, path, lambda i=i: f"record {i}")


def _read_csv(path: str, field: str) -> Iterator[str | None]:
    with _open_binary(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        try:
            if field not in (reader.fieldnames or []):
                raise ConfigError(
                    "data.text_field",
                    f"{path} has no column {field!r} (its columns: {', '.join(reader.fieldnames or []) or 'none'})",
                    "set it to one of them",
                )
            for row in reader:
                yield row[field]
        except (csv.Error, UnicodeDecodeError) as err:
            raise _bad_file(path, f"line {reader.line_num}", f"not CSV ({err})") from None


def _column(table_names: Sequence[str], field: str, path: str) -> None:
    if field not in table_names:
        raise ConfigError(
            "data.text_field",
            f"{path} has no column {field!r} (its columns: {', '.join(table_names) or 'none'})",
            "set it to one of them",
        )


def _strings(column, path: str, first_row: int):
    """A column of strings, as one Arrow array."""
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise _bad_file(path, f"rows {first_row}..{first_row + len(column) - 1}", f"hold {column.type}, not text")
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _read_parquet(path: str, field: str, start: int = 0, stop: int | None = None) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors are of many kinds
        raise _bad_file(path, "(the whole file)", f"not Parquet ({err})") from None
    _column(pf.schema_arrow.names, field, path)
    stop = pf.metadata.num_row_groups if stop is None else stop
    row = sum(pf.metadata.row_group(i).num_rows for i in range(start))
    for group in range(start, stop):
        column = pf.read_row_group(group, columns=[field]).column(0)
        yield _strings(column, path, row)
        row += len(column)


def _read_arrow(path: str, field: str) -> Iterator[str | None]:
    import pyarrow as pa

    try:
        try:
            table = pa.ipc.open_file(path).read_all()
        except pa.ArrowInvalid:  # the stream format (datasets' cache files)
            table = pa.ipc.open_stream(path).read_all()
    except Exception as err:
        raise _bad_file(path, "(the whole file)", f"not Arrow ({err})") from None
    _column(table.column_names, field, path)
    yield _strings(table.column(field), path, 0)


def _load_saved(path: str):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(
            "data.paths", f"{path} holds splits ({', '.join(ds)}), not one dataset", "point at one split's directory"
        )
    return ds


def _load_hub(spec: dict[str, Any]):
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_dataset(**{k: v for k, v in spec.items() if k != "max_documents"})


def _read_rows(ds, path: str, field: str, start: int, stop: int | None) -> Iterator[str | None]:
    _column(ds.column_names, field, path)
    ds = ds.select_columns([field]).with_format("arrow")
    stop = ds.num_rows if stop is None else stop
    for a in range(start, stop, 10_000):
        yield _strings(ds[a : min(a + 10_000, stop)].column(0), path, a)


def read(fmt: str, source: str, field: str, start: int = 0, stop: int | None = None) -> Iterator[str | None]:
    """The texts of one file (or the hub dataset whose load_dataset arguments `source` holds as JSON): all of
    it, or a range (bytes of JSON Lines, row groups of Parquet, rows of a dataset)."""
    try:
        yield from _texts(fmt, source, field, start, stop)
    except OSError as err:  # not to be taken for a failure to write the store
        raise _bad_file(source, "(reading it)", f"{type(err).__name__}: {err}") from None


def _texts(fmt: str, source: str, field: str, start: int, stop: int | None) -> Iterator[str | None]:
    if fmt == "hub":
        spec = json.loads(source)
        ds = _load_hub(spec)
        if spec["streaming"]:
            rows = enumerate(ds.take(spec["max_documents"]))
            return (_text_of(row, field, spec["path"], lambda i=i: f"row {i}") for i, row in rows)
        return _read_rows(ds, spec["path"], field, start, stop)
    if fmt == "saved":
        return _read_rows(_load_saved(source), source, field, start, stop)
    if fmt in ("jsonl", "parquet"):
        return (_read_jsonl if fmt == "jsonl" else _read_parquet)(source, field, start, stop)
    return {"text": _read_text, "json": _read_json, "csv": _read_csv, "arrow": _read_arrow}[fmt](source, field)


def dataset_size(fmt: str, source: str) -> tuple[int, int]:
    """(rows, bytes) of a saved or hub dataset."""
    ds = _load_hub(json.loads(source)) if fmt == "hub" else _load_saved(source)
    return ds.num_rows, ds.data.nbytes


def row_groups(path: str) -> list[int]:
    """The byte size of each row group of a Parquet file."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def hub_records(name: str, config: str | None, split: str, cache_dir: str | None) -> Iterator[tuple[str, Any]]:
    """Whole records of a hub dataset (or a local directory load_dataset reads), each with its row."""
    spec = {"path": name, "name": config, "split": split, "cache_dir": cache_dir}
    yield from ((f"row {i}", row) for i, row in enumerate(_load_hub(spec)))


def read_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Whole records (a chat's list of messages is no text field), each with where it is ("line 3", "row 7"):
    JSON Lines, JSON, Parquet, a saved dataset."""
    fmt = file_format(path)
    if fmt in ("jsonl", "json"):
        with _open_binary(path) as f:
            data = f.read()
        if fmt == "json" and data.lstrip().startswith(b"["):
            try:
                records = json.loads(data)
            except ValueError as err:
                raise _bad_file(path, "(the whole file)", f"not JSON ({err})") from None
            yield from ((f"record {i}", r) for i, r in enumerate(records))
            return
        for i, line in enumerate(data.split(b"\n")):
            if line.strip():
                try:
                    yield f"line {i + 1}", json.loads(line)
                except ValueError as err:
                    raise _bad_file(path, f"line {i + 1}", f"not JSON ({err})") from None
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif fmt == "saved":
        rows = _load_saved(path)
    else:
        raise ConfigError("data.paths", f"{path} is {fmt}, which holds no records", "use JSON Lines, JSON or Parquet")
    yield from ((f"row {i}", row) for i, row in enumerate(rows))
