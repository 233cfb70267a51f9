"""Which window each sample of training is, as a pure function of (seed, global sample index): the same at any world
size, exact on resume (also at another world size), and with no memory that grows with the corpus.

A source's windows are seq_len + 1 consecutive tokens of its store (documents concatenated with their
end-of-document tokens; only the last partial window is dropped). A stateless pseudo-random permutation (a
Feistel network, cycle-walked to the window count) sets a held-out set aside once, as a function of the data and
the seed, and shuffles the rest afresh every epoch. A mixture assigns samples to sources in blocks of BLOCK
samples whose composition follows the weights exactly (to 1 / BLOCK), in an order shuffled per block."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fsdp_research.data.store import TokenStore

BLOCK = 4096
_ROUNDS = 4
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective scramble of uint64 values."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


# Cached: every batch asks for the same few keys (the rounds', the epoch's), read ahead on a thread that takes
# cores and the interpreter lock from the step.
@functools.lru_cache(maxsize=4096)
def key(*parts: int) -> int:
    """One 64-bit key from several integers (a seed, a source, an epoch, a purpose)."""
    value = np.zeros(1, np.uint64)
    for part in parts:
        value = _mix(value ^ np.uint64(part % 2**64))
    return int(value[0])


def permute(index: np.ndarray, n: int, seed: int) -> np.ndarray:
    """The images of `index` (values in [0, n)) under a pseudo-random permutation of [0, n) chosen by seed."""
    index = np.asarray(index, dtype=np.uint64)
    if n <= 1:
        return index.astype(np.int64)
    half = max(1, (int(n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(key(seed, r)) for r in range(_ROUNDS)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(index)
    # Cycle-walking: the network permutes [0, 4^half), which holds n; values outside are walked back in.
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = feistel(out[outside])
        outside = out >= np.uint64(n)
    return out.astype(np.int64)


class StoreWindows:
    """A token store read as windows of `length` tokens; with a limit, only its first `limit` windows."""

    def __init__(self, store: TokenStore, length: int, limit: int = 0):
        self.store, self.length = store, length
        self.count = store.n_tokens // length
        if limit:
            self.count = min(self.count, limit)

    def read(self, index: np.ndarray) -> np.ndarray:
        return np.stack([self.store.tokens(i * self.length, (i + 1) * self.length) for i in index.tolist()])


class SyntheticWindows:
    """`count` windows of random tokens, each a function of (seed, its index) alone."""

    def __init__(self, count: int, length: int, vocab_size: int, seed: int):
        self.count, self.length, self.vocab_size, self.seed = count, length, vocab_size, seed

    def read(self, index: np.ndarray) -> np.ndarray:
        rows = [np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.length) for i in index.tolist()]
        return np.stack(rows).astype(np.int64)


@dataclass(frozen=True)
class Split:
    """A source's windows split once into held-out and training windows, by a permutation of them all."""

    count: int
    held_out: int
    seed: int

    @property
    def train(self) -> int:
        return self.count - self.held_out

    def train_window(self, local: np.ndarray) -> np.ndarray:
        """The window of this source's local-th training sample: epoch after epoch, each a fresh order."""
        epoch, position = np.divmod(local, self.train)
        out = np.empty_like(position)
        for e in np.unique(epoch).tolist():
            chosen = epoch == e
            out[chosen] = permute(position[chosen], self.train, key(self.seed, 1, e))
        return permute(out, self.count, key(self.seed, 0))

    def held_out_window(self, k: np.ndarray) -> np.ndarray:
        return permute(self.train + k % self.held_out, self.count, key(self.seed, 0))


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """Integer counts summing to total in the proportions of weights (largest remainders)."""
    exact = np.asarray(weights, dtype=np.float64) / sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]] += 1
    return counts


class Mixture:
    """Sample g -> (source, the source's local sample index), by blocks of BLOCK samples of fixed composition."""

    def __init__(self, weights: Sequence[float], seed: int):
        self.counts = apportion(BLOCK, weights)
        self.labels = np.repeat(np.arange(len(weights)), self.counts)
        self.seed = seed
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's source per position, and each position's rank among its source's positions."""
        if b not in self._cache:
            source = self.labels[permute(np.arange(BLOCK), BLOCK, key(self.seed, 2, b))]
            rank = np.empty(BLOCK, np.int64)
            for s in range(len(self.counts)):
                rank[source == s] = np.arange(int(self.counts[s]))
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[b] = (source, rank)
        return self._cache[b]

    def assign(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks, positions = np.divmod(g, BLOCK)
        source, local = np.empty_like(g), np.empty_like(g)
        for b in np.unique(blocks).tolist():
            chosen = blocks == b
            block_source, block_rank = self._block(b)
            source[chosen] = block_source[positions[chosen]]
            local[chosen] = b * self.counts[source[chosen]] + block_rank[positions[chosen]]
        return source, local


class Stream:
    """Training and held-out samples by index, over one or several sources (a mixture by weight)."""

    def __init__(self, windows: Sequence, weights: Sequence[float], seed: int, eval_fraction: float):
        self.windows = list(windows)
        held_out = [max(1, int(w.count * eval_fraction)) if eval_fraction > 0 else 0 for w in self.windows]
        self.splits = [Split(w.count, h, key(seed, 3, s)) for s, (w, h) in enumerate(zip(self.windows, held_out))]
        self.train_mixture = Mixture(weights, key(seed, 4))
        self.eval_mixture = Mixture(weights, key(seed, 5))
        self.length = self.windows[0].length
        # A window of tokens, or a packed sample ([3, seq_len]: fsdp_research.data.packing).
        self.shape = getattr(self.windows[0], "shape", (self.length,))

    def _read(self, source: np.ndarray, window: np.ndarray) -> np.ndarray:
        out = np.empty((len(source), *self.shape), np.int64)
        for s in np.unique(source).tolist():
            chosen = source == s
            out[chosen] = self.windows[s].read(window[chosen])
        return out

    def train(self, index: np.ndarray) -> np.ndarray:
        """Training samples index (global sample indices: step * global batch + position)."""
        source, local = self.train_mixture.assign(np.asarray(index, np.int64))
        window = np.empty_like(local)
        for s in np.unique(source).tolist():
            chosen = source == s
            window[chosen] = self.splits[s].train_window(local[chosen])
        return self._read(source, window)

    def held_out(self, index: np.ndarray) -> np.ndarray:
        """Held-out samples index: the eval set is held_out(0 .. n-1), at any world size."""
        source, local = self.eval_mixture.assign(np.asarray(index, np.int64))
        window = np.empty_like(local)
        for s in np.unique(source).tolist():
            chosen = source == s
            window[chosen] = self.splits[s].held_out_window(local[chosen])
        return self._read(source, window)
