"""Documents with per-token targets as training samples of seq_len positions, each a [3, seq_len] array: the input
ids, the labels (the next token where it is a target, else IGNORE, as transformers' losses take them) and the
position ids. Whole documents are packed in order into windows (data.packing), never split, the rest padded with
non-targets. With document masking each document's positions start at 0: transformers' packed-sequence path then
lets each attend to itself only (its mask functions read the restarts); a document's last position predicts
nothing, so a packed document's loss is the same document's fed alone (DataCollatorWithFlattening's rule)."""

from collections.abc import Sequence

import numpy as np

from fsdp_research.data.chat import Document

IGNORE = -100
INPUTS, LABELS, POSITIONS = 0, 1, 2


def _labels(doc: Document) -> np.ndarray:
    labels = np.full(len(doc.ids), IGNORE, np.int64)
    labels[:-1] = np.where(doc.targets[1:], doc.ids[1:], IGNORE)
    return labels


def pack(docs: Sequence[Document], seq_len: int, pad_id: int, packing: bool, masking: bool) -> np.ndarray:
    """[windows, 3, seq_len]: the documents in order, each whole in one window (every one at most seq_len)."""
    windows: list[list[Document]] = []
    used = seq_len
    for doc in docs:
        if not packing or used + len(doc.ids) > seq_len:
            windows.append([])
            used = 0
        windows[-1].append(doc)
        used += len(doc.ids)
    out = np.empty((len(windows), 3, seq_len), np.int64)
    for w, window in enumerate(windows):
        row = out[w]
        row[INPUTS], row[LABELS] = pad_id, IGNORE
        at = 0
        for doc in window:
            n = len(doc.ids)
            row[INPUTS, at : at + n] = doc.ids
            row[LABELS, at : at + n] = _labels(doc)
            row[POSITIONS, at : at + n] = np.arange(n) if masking else np.arange(at, at + n)
            at += n
        # The padding: a document of its own (masking) or the run of positions going on.
        row[POSITIONS, at:] = np.arange(seq_len - at) if masking else np.arange(at, seq_len)
    return out


class PackedWindows:
    """Packed samples by index (a source of fsdp_research.data.sampling.Stream)."""

    def __init__(self, samples: np.ndarray, what: str):
        self.samples, self.what = samples, what
        self.count, self.shape = len(samples), samples.shape[1:]
        self.length = samples.shape[-1]

    def read(self, index: np.ndarray) -> np.ndarray:
        return self.samples[index]

    def describe(self) -> str:
        targets = (self.samples[:, LABELS] != IGNORE).sum()
        return f"{self.what}, {targets / self.samples[:, LABELS].size:.0%} of the positions targets"


class DocumentWindows:
    """A token store's windows of seq_len + 1 tokens (fsdp_research.data.sampling.StoreWindows) as packed samples
    (data.document_masking for text): each document of a window attends to itself only, its positions from 0 (a
    document the window starts inside from the window's start), and the token that ends one document does not
    predict the next one's first. The boundaries are the store's document index."""

    def __init__(self, windows):
        self.windows, self.store = windows, windows.store
        self.count, self.length = windows.count, windows.length - 1
        self.shape = (3, self.length)
        self.ends = self.store.document_ends()

    def read(self, index: np.ndarray) -> np.ndarray:
        n, span = self.length, self.windows.length
        out = np.empty((len(index), 3, n), np.int64)
        for row, i in zip(out, index.tolist()):
            tokens = self.store.tokens(i * span, (i + 1) * span)
            row[INPUTS], row[LABELS] = tokens[:-1], tokens[1:]
            # Documents starting at window positions 1..n: the position before predicts nothing.
            lo, hi = np.searchsorted(self.ends, [i * span + 1, i * span + n], side="left")
            starts = self.ends[lo : hi + 1] - i * span
            starts = starts[(starts >= 1) & (starts <= n)]
            row[LABELS, starts - 1] = IGNORE
            first = np.zeros(n, np.int64)
            first[starts[starts < n]] = starts[starts < n]
            row[POSITIONS] = np.arange(n) - np.maximum.accumulate(first)
        return out
