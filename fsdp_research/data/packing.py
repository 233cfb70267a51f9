"""Documents with per-token targets as training samples of seq_len positions, each a [3, seq_len] array: the input
ids, the labels (the next token where it is a target, else IGNORE, as transformers' losses take them) and the
position ids. Whole documents are packed into windows (data.packing) best-fit decreasing, as TRL's SFTTrainer packs
(the longest first, each into the window it leaves the least room in), never split, the rest padded with
non-targets; the windows are then shuffled (a fixed permutation: the packing is a function of the data). With
document masking each document's positions start at 0: transformers' packed-sequence path then lets each attend to
itself only (its mask functions read the restarts); a document's last position predicts nothing, so a packed
document's loss is the same document's fed alone (DataCollatorWithFlattening's rule). Text eval sets under
document masking are packed so too (TextDocuments), every token after a document's first a target."""

from collections import defaultdict

import numpy as np

from fsdp_research.config.data_schema import Truncation
from fsdp_research.data.store import TokenStore
from fsdp_research.errors import ConfigError

IGNORE = -100
INPUTS, LABELS, POSITIONS = 0, 1, 2
# Preference samples' fourth row: each position's document, as its index in the store (-1: padding).
DOCUMENTS = 3


class _Rooms:
    """Open windows by the room they have left: the one with the least room of at least n in O(log seq_len) (a
    tree over room sizes, each node saying whether a window has a room size in its range)."""

    def __init__(self, seq_len: int):
        self.size = 1 << seq_len.bit_length()
        self.any = [False] * (2 * self.size)
        self.windows: dict[int, list[int]] = defaultdict(list)

    def _mark(self, room: int, on: bool) -> None:
        i = room + self.size
        self.any[i] = on
        while i > 1:
            i >>= 1
            self.any[i] = self.any[2 * i] or self.any[2 * i + 1]

    def add(self, room: int, window: int) -> None:
        self.windows[room].append(window)
        if len(self.windows[room]) == 1:
            self._mark(room, True)

    def take(self, n: int) -> tuple[int, int] | None:
        """(room, window): the least room of at least n, taken out; None if no window has n."""
        i = n + self.size
        if not self.any[i]:
            while i > 1 and not (i % 2 == 0 and self.any[i + 1]):
                i >>= 1
            if i == 1:
                return None
            i += 1
            while i < self.size:
                i = 2 * i if self.any[2 * i] else 2 * i + 1
        room = i - self.size
        window = self.windows[room].pop()
        if not self.windows[room]:
            self._mark(room, False)
        return room, window


def assign(lengths: np.ndarray, seq_len: int, packing: bool) -> tuple[np.ndarray, np.ndarray]:
    """Documents (indices into lengths, each at most seq_len) into windows: (documents, starts), window w holding
    documents[starts[w]:starts[w + 1]]. Packing: best-fit decreasing, the windows shuffled; else one a window."""
    if not packing:
        return np.arange(len(lengths)), np.arange(len(lengths) + 1)
    windows: list[list[int]] = []
    rooms = _Rooms(seq_len)
    for doc in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[doc])
        found = rooms.take(n)
        if found is None:
            room, window = seq_len, len(windows)
            windows.append([])
        else:
            room, window = found
        windows[window].append(doc)
        if room > n:
            rooms.add(room - n, window)
    windows = [windows[w] for w in np.random.default_rng(0).permutation(len(windows))]
    starts = np.cumsum([0, *map(len, windows)])
    return np.fromiter((d for w in windows for d in w), np.int64, int(starts[-1])), starts


def fill(row: np.ndarray, docs: list[tuple[np.ndarray, np.ndarray]], pad_id: int, masking: bool) -> None:
    """One window ([3, seq_len]) of (ids, targets) documents, in order, then padding."""
    seq_len = row.shape[-1]
    row[INPUTS], row[LABELS] = pad_id, IGNORE
    at = 0
    for ids, targets in docs:
        n = len(ids)
        row[INPUTS, at : at + n] = ids
        row[LABELS, at : at + n - 1] = np.where(targets[1:], ids[1:], IGNORE)
        row[POSITIONS, at : at + n] = np.arange(n) if masking else np.arange(at, at + n)
        at += n
    # The padding: a document of its own (masking) or the run of positions going on.
    row[POSITIONS, at:] = np.arange(seq_len - at) if masking else np.arange(at, seq_len)


def documents_of(store: TokenStore) -> tuple[np.ndarray, np.ndarray]:
    """Each document's first token and length, from the store's document index."""
    ends = store.document_ends()
    first = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return first, ends - first


def refuse_longer(lengths: np.ndarray, seq_len: int, truncation: Truncation, what: str) -> None:
    """data.truncation=error: the longest of `lengths` over seq_len refused, named by `what`."""
    longest = int(lengths.max(initial=0))
    if longest > seq_len and truncation is Truncation.error:
        raise ConfigError(
            "data.truncation",
            f"{what} has {longest} tokens, more than data.seq_len={seq_len}",
            "raise data.seq_len, or set data.truncation=drop or truncate",
        )


class PackedDocuments:
    """Spans of a store (first token, length) packed into windows by index (a source of
    fsdp_research.data.sampling.Stream): window w holds the spans docs[starts[w]:starts[w + 1]], their tokens read
    as windows are asked for."""

    store: TokenStore
    first: np.ndarray
    lengths: np.ndarray
    docs: np.ndarray
    starts: np.ndarray
    pad_id: int
    masking: bool
    shape: tuple[int, int]

    def span_targets(self, start: int, stop: int) -> np.ndarray:
        """Which of the tokens [start, stop) are targets."""
        raise NotImplementedError

    def read(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((len(index), *self.shape), np.int64)
        for row, w in zip(out, index.tolist()):
            docs = []
            for d in self.docs[self.starts[w] : self.starts[w + 1]].tolist():
                a, b = int(self.first[d]), int(self.first[d] + self.lengths[d])
                docs.append((self.store.tokens(a, b), self.span_targets(a, b)))
            fill(row, docs, self.pad_id, self.masking)
        return out


class ChatWindows(PackedDocuments):
    """A store of documents with targets (fsdp_research.data.chat_store) packed into samples: its document index,
    lengths and target counts in memory (O(documents)). Documents longer than seq_len are dropped, cut or refused
    (data.truncation); those with no target token are left out."""

    def __init__(
        self, store: TokenStore, seq_len: int, pad: int, packing: bool, masking: bool, truncation: Truncation, what: str
    ):
        self.store, self.length, self.shape = store, seq_len, (3, seq_len)
        self.pad_id, self.masking = pad, masking
        self.first, self.lengths = documents_of(store)
        counts = store.target_counts()
        refuse_longer(self.lengths, seq_len, truncation, f"a document of {what}")
        keep = counts > 0
        self.dropped = int((keep & (self.lengths > seq_len)).sum()) if truncation is Truncation.drop else 0
        if truncation is Truncation.drop:
            keep &= self.lengths <= seq_len
        else:  # cut: a cut document's targets counted again over what is left
            for d in np.flatnonzero(keep & (self.lengths > seq_len)).tolist():
                counts[d] = int(store.targets(self.first[d] + 1, self.first[d] + seq_len).sum())
            self.lengths = np.minimum(self.lengths, seq_len)
            keep &= counts > 0
        self.untargeted = int((counts == 0).sum())
        kept = np.flatnonzero(keep)
        order, self.starts = assign(self.lengths[kept], seq_len, packing)
        self.docs = kept[order]
        self.count = len(self.starts) - 1
        self.targets = int(counts[kept].sum())
        self.what = what

    def span_targets(self, start: int, stop: int) -> np.ndarray:
        return self.store.targets(start, stop)

    def describe(self) -> str:
        positions = self.count * self.length
        filled = int(self.lengths[self.docs].sum())
        left_out = f"; {self.untargeted:,} with no target token left out" if self.untargeted else ""
        if self.dropped:
            left_out += f"; {self.dropped:,} longer than data.seq_len dropped"
        return (
            f"{len(self.docs):,} conversations of {self.what} ({filled / positions:.0%} of "
            f"the positions filled, {self.targets / positions:.0%} targets{left_out})"
        )


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


class TextDocuments(PackedDocuments):
    """A text store's documents packed whole into windows of seq_len positions (an eval set under
    data.document_masking, read whole): each once, its positions from 0, every token after its first a target, so
    that its loss is the document's fed alone. A document longer than seq_len goes in pieces of at most seq_len
    tokens, each fed alone (its positions from 0), each after the first starting at the previous one's last token:
    every token after the document's first is still a target once, predicted from the tokens of its piece before it
    (data.truncation is chat's: an eval set keeps all of its text). Documents of one token (no target) are left
    out."""

    def __init__(self, store: TokenStore, seq_len: int, pad: int, what: str):
        self.store, self.length, self.shape = store, seq_len, (3, seq_len)
        self.pad_id, self.masking, self.what = pad, True, what
        starts, lengths = documents_of(store)
        # seq_len - 1 targets a piece, the last piece the rest; a window of one position holds no target.
        stride = seq_len - 1
        pieces = -(-(lengths - 1) // stride) if stride else np.zeros_like(lengths)
        doc = np.repeat(np.arange(len(lengths)), pieces)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.first = starts[doc] + k * stride
        self.lengths = np.minimum(seq_len, lengths[doc] - k * stride)
        self.documents, self.in_pieces = int((pieces > 0).sum()), int((pieces > 1).sum())
        self.docs, self.starts = assign(self.lengths, seq_len, packing=True)
        self.count = len(self.starts) - 1
        self.targets = int((self.lengths - 1).sum())

    def span_targets(self, start: int, stop: int) -> np.ndarray:
        return np.ones(stop - start, bool)

    def describe(self) -> str:
        pieces = f", {self.in_pieces:,} longer than data.seq_len in pieces" if self.in_pieces else ""
        filled = self.lengths.sum() / (self.count * self.length)
        return f"{self.documents:,} documents of {self.what} packed whole ({filled:.0%} of positions filled{pieces})"


class PairWindows(PackedDocuments):
    """A store of preference pairs (documents 2i and 2i + 1: the prompt with its chosen completion, then with its
    rejected one) packed into samples a pair at a time, never split: the two side by side in one sample, each
    attending to itself only (its positions from 0), so that a pair's log-probabilities are its sequences' fed
    alone; a fourth row says each position's document (DOCUMENTS: the store's index, which precomputed reference
    log-probabilities are looked up by). data.packing: several pairs a sample, best-fit decreasing; else one a
    sample, padded. A pair longer
    than seq_len is dropped or refused (data.truncation), or with truncate each of its sequences cut to its first
    seq_len // 2 tokens (TRL's max_length, keep_start); one whose completions hold no target (after a cut: whose
    prompt fills the half, which TRL drops too) is left out."""

    def __init__(self, store: TokenStore, seq_len: int, pad: int, packing: bool, truncation: Truncation, what: str):
        self.store, self.length, self.shape = store, seq_len, (4, seq_len)
        self.pad_id, self.masking, self.what = pad, True, what
        self.first, self.lengths = documents_of(store)
        counts = store.target_counts()
        if truncation is Truncation.truncate:
            half = seq_len // 2
            for d in np.flatnonzero(self.lengths > half).tolist():
                counts[d] = int(store.targets(self.first[d] + 1, self.first[d] + half).sum())
            self.lengths = np.minimum(self.lengths, half)
        pair_lengths = self.lengths[0::2] + self.lengths[1::2]
        longest = int(pair_lengths.max(initial=0))
        if longest > seq_len and truncation is Truncation.error:
            raise ConfigError(
                "data.truncation",
                f"a pair of {what} has {longest} tokens (prompt twice, both completions), more than data.seq_len="
                f"{seq_len}",
                "raise data.seq_len, or set data.truncation=drop or truncate",
            )
        keep = (counts[0::2] > 0) & (counts[1::2] > 0)
        self.untargeted = int((~keep).sum())
        self.dropped = int((keep & (pair_lengths > seq_len)).sum())
        kept = np.flatnonzero(keep & (pair_lengths <= seq_len))
        order, starts = assign(pair_lengths[kept], seq_len, packing)
        self.pairs = kept[order]
        self.docs = np.stack([2 * self.pairs, 2 * self.pairs + 1], 1).reshape(-1)
        self.starts = 2 * starts
        self.count = len(starts) - 1

    def span_targets(self, start: int, stop: int) -> np.ndarray:
        return self.store.targets(start, stop)

    def read(self, index: np.ndarray) -> np.ndarray:
        """[n, 4, seq_len]: the packed rows, and each position's document (DOCUMENTS)."""
        out = super().read(index)
        for row, w in zip(out, index.tolist()):
            docs = self.docs[self.starts[w] : self.starts[w + 1]]
            row[DOCUMENTS] = -1
            row[DOCUMENTS, : int(self.lengths[docs].sum())] = np.repeat(docs, self.lengths[docs])
        return out

    def describe(self) -> str:
        filled = int(self.lengths[self.docs].sum()) / max(1, self.count * self.length)
        left_out = f"; {self.untargeted:,} with an empty completion left out" if self.untargeted else ""
        if self.dropped:
            left_out += f"; {self.dropped:,} longer than data.seq_len dropped"
        return f"{len(self.pairs):,} pairs of {self.what} ({filled:.0%} of the positions filled{left_out})"
