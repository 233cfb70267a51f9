"""The token store: a source tokenized once into flat token files (uint16 while the vocabulary fits, else
uint32) and a document index, read by every rank at the positions it needs, so that no rank's memory grows with the
corpus.

A store lives in <store root>/<fingerprint>/: the fingerprint is of the source (every file's path, size and
modification time, or the hub dataset), the text field, the tokenizer (what it does, not its name) and the
end-of-document token. Sequence length is not in it: windows are cut when read. A build writes parts into
<store root>/.build-<fingerprint>/ (each part published there by rename, with a marker that says it is
complete, so an interrupted build resumes where it stopped) and the store appears by renaming that directory
once its manifest (every file and its size) is written: a killed or failed build never leaves a store that a
later run would read.

How a store is built: fsdp_research.data.store_builder."""

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_research.data.parts import Part
from fsdp_research.data.tokenizer import load_tokenizer

log = logging.getLogger("fsdp_research")

VERSION = 1
MANIFEST = "manifest.json"
KEY = "key.json"


@dataclass(frozen=True)
class StoreSpec:
    """What a store is built from: its parts, in document order (planned when first asked for: only a build
    needs them), and the key its fingerprint is taken of."""

    plan: Callable[[], Sequence[Part]]
    key: str  # JSON
    tokenizer: str
    # How a part of documents that are not plain text is built in this process: (part, index, build dir) -> its
    # counts, its files written as build_part writes them (chat: fsdp_research.data.chat_store). None: text.
    build: Callable[[Part, int, str], dict[str, Any]] | None = None

    @functools.cached_property
    def parts(self) -> tuple[Part, ...]:
        return tuple(self.plan())

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:24]


def store_spec(parts: Callable[[], Sequence[Part]], identity: Any, text_field: str, tokenizer_name: str) -> StoreSpec:
    """The spec of a source's store: parts() plans its parts; identity names the source's content (its files, or
    the hub dataset)."""
    tok = load_tokenizer(tokenizer_name)
    key = {
        "version": VERSION,
        "source": identity,
        "text_field": [text_field],
        "tokenizer": tok.fingerprint,
        "eos": tok.eos_id,
        "dtype": tok.dtype.name,
    }
    return StoreSpec(parts, json.dumps(key, sort_keys=True), tokenizer_name)


def part_name(index: int) -> str:
    return f"part_{index:05d}"


def verify(path: str, fingerprint: str) -> str | None:
    """None when the store at path is complete and is the one asked for; otherwise what is wrong with it."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"no valid {MANIFEST} ({type(err).__name__})"
    if manifest.get("fingerprint") != fingerprint:
        return "its manifest is of another source or tokenizer"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"missing {name}"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {size}"
    return None


class TokenStore:
    """A published store: tokens by global position, documents by index."""

    def __init__(self, path: str):
        self.path = path
        self._fds: dict[tuple[int, str], int] = {}
        with open(os.path.join(path, MANIFEST)) as f:
            self.manifest = json.load(f)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.offsets = np.concatenate([[0], np.cumsum([p["tokens"] for p in self.manifest["parts"]])]).astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.n_documents = int(self.manifest["documents"])

    def _fd(self, i: int, suffix: str) -> int:
        if (i, suffix) not in self._fds:
            self._fds[i, suffix] = os.open(os.path.join(self.path, f"{part_name(i)}{suffix}"), os.O_RDONLY)
        return self._fds[i, suffix]

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated parts, as int64. Positioned reads (pread), not a memory map:
        mapped pages count toward every rank's resident memory (2 MB per window touched, with large folios),
        while the page cache the two share holds the data either way."""
        return self._read(start, stop, ".tokens", self.dtype, np.int64)

    def targets(self, start: int, stop: int) -> np.ndarray:
        """Which of the tokens [start, stop) are trained on (a store of documents with targets: a byte a token)."""
        return self._read(start, stop, ".targets", np.dtype(np.uint8), bool)

    def _read(self, start: int, stop: int, suffix: str, dtype: np.dtype, out_dtype) -> np.ndarray:
        out = np.empty(stop - start, dtype=out_dtype)
        part = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pos, size = start, dtype.itemsize
        while pos < stop:
            end = min(stop, int(self.offsets[part + 1]))
            data = os.pread(self._fd(part, suffix), (end - pos) * size, (pos - int(self.offsets[part])) * size)
            out[pos - start : end - start] = np.frombuffer(data, dtype)
            pos, part = end, part + 1
        return out

    def __del__(self) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def document_ends(self) -> np.ndarray:
        """Where each document ends (exclusive), in global token positions (the document index; loaded whole)."""
        return self._per_document(".docs.npy", shift=True)

    def target_counts(self) -> np.ndarray:
        """A store of documents with targets: how many of each document's tokens after its first are targets (the
        labels its loss counts)."""
        return self._per_document(".counts.npy")

    def labels(self) -> np.ndarray:
        """A preference store's: which document is the preferred one (1), which not (0)."""
        return self._per_document(".labels.npy")

    def record(self, document: int) -> bytes:
        """A prompt store's (one part, fsdp_research.data.chat_store): a document's record, a line of JSON; the
        index of where each ends is loaded once."""
        if not hasattr(self, "_record_ends"):
            self._record_ends = np.concatenate([[0], self._per_document(".records.npy")])
        start, stop = int(self._record_ends[document]), int(self._record_ends[document + 1])
        return os.pread(self._fd(0, ".records"), stop - start, start)

    def record_fields(self) -> list[str]:
        """A prompt store's: the fields any of its records holds, in the order they first come."""
        with open(os.path.join(self.path, f"{part_name(0)}.fields")) as f:
            return json.load(f)

    def _per_document(self, suffix: str, shift: bool = False) -> np.ndarray:
        arrays = [
            np.load(os.path.join(self.path, f"{part_name(i)}{suffix}")) + (self.offsets[i] if shift else 0)
            for i in range(len(self.manifest["parts"]))
        ]
        return np.concatenate(arrays).astype(np.int64) if arrays else np.empty(0, np.int64)


# Building.
