"""A parameter's recipe: the writes made to it (torch.nn.init's elementwise draws, fills, copies, in-place
arithmetic), each on the region of rows it touched, as model.recorded_init records them; and its replay on any of
its rows. Replay cuts the rows into chunks of at most CHUNK elements, fixed by the shape alone, each drawing from a
generator of its own (the parameter's seed and the chunk's index): the values of a row are the same whichever rank
builds it, at any world size."""

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

CHUNK = 2**18

_RANDOM = {"normal_", "uniform_", "trunc_normal_", "bernoulli_", "exponential_", "log_normal_", "cauchy_"}
_RANDOM |= {"geometric_", "random_"}
# Writes that do not read what was there: one over the whole parameter initialises it.
_FILLS = _RANDOM | {"constant_", "ones_", "zeros_", "zero_", "fill_", "copy_"}


class Unsupported(Exception):
    """A write the recorder cannot replay row by row (its message says which)."""


@dataclass
class Write:
    func: object
    rows: tuple[int, int]
    # The region within each row: (shape, strides, offset) of a row-range view, or of a view inside one row.
    inner: tuple[tuple[int, ...], tuple[int, ...], int]
    row_dim: bool
    args: tuple
    kwargs: dict
    sliced: tuple[int, ...]  # positions in args of real tensors of the region's shape: cut to the rows replayed
    versions: tuple[tuple[torch.Tensor, int], ...] = ()  # the tensor arguments, as they were when written

    @property
    def fills(self) -> bool:
        return getattr(self.func, "__name__", "") in _FILLS


@dataclass
class Recipe:
    shape: tuple[int, ...]
    writes: list[Write] = field(default_factory=list)
    # Why a write into it cannot be replayed: kept even where the code that made the write caught the error.
    failed: str | None = None

    def settled(self) -> "Recipe":
        """A copy of the writes so far, each argument checked unchanged since (a later in-place change of a
        copied tensor would go unseen); raises Unsupported where a write could not be recorded."""
        changed = any(t._version != v for w in self.writes for t, v in w.versions)
        if self.failed or changed:
            raise Unsupported(self.failed or "a tensor written into a parameter changed afterwards")
        return Recipe(self.shape, list(self.writes))

    def covers(self) -> bool:
        """A write that sets every value without reading it (what was there before never shows)."""
        rows = rows_of(self.shape)
        return any(
            w.fills
            and w.rows == (0, rows)
            and _count(w.inner) * (rows if w.row_dim else 1) == rows * row_size(self.shape)
            for w in self.writes
        )


def rows_of(shape) -> int:  # a scalar is one row of one element
    return shape[0] if shape else 1


def row_size(shape) -> int:
    return math.prod(shape[1:]) if shape else 1


def _count(inner) -> int:
    return math.prod(inner[0])


def whole_write(func, shape: tuple[int, ...], args: tuple) -> Write:
    """One write over every element of a parameter of `shape`."""
    size = row_size(shape)
    return Write(func, (0, rows_of(shape)), ((size,), (1,), 0), True, args, {}, ())


def _chunks(shape, first: int, last: int) -> Iterator[tuple[int, int, int]]:
    """(index, first row, end row) of the chunks holding rows first..last-1."""
    rows, per = rows_of(shape), max(1, CHUNK // max(1, row_size(shape)))
    for k in range(first // per, -(-last // per)):
        yield k, k * per, min(rows, (k + 1) * per)


def _apply(write: Write, chunk: torch.Tensor, start: int, end: int, size: int, generator) -> None:
    lo, hi = max(write.rows[0], start), min(write.rows[1], end)
    if lo >= hi:
        return
    dims, strides, offset = write.inner
    if write.row_dim:
        view = chunk.as_strided((hi - lo, *dims), (size, *strides), (lo - start) * size + offset)
        args = tuple(
            a[lo - write.rows[0] : hi - write.rows[0]] if i in write.sliced else a for i, a in enumerate(write.args)
        )
    else:
        view, args = chunk.as_strided(dims, strides, (lo - start) * size + offset), write.args
    kwargs = write.kwargs
    if getattr(write.func, "__name__", "") in _RANDOM:
        args = tuple(a for a in args if not isinstance(a, torch.Generator))
        kwargs = {**kwargs, "generator": generator}
    with torch.no_grad():
        write.func(view, *args, **kwargs)


def replay(recipe: Recipe, first: int, last: int, seed: int, start=None) -> torch.Tensor:
    """Rows first..last-1 of the recorded parameter (float32, on the CPU); `start(first, last, generator)` gives
    a chunk's values before the writes (NaN if not given: what nothing writes stays unset)."""
    shape, size = recipe.shape, row_size(recipe.shape)
    out = torch.empty((last - first, *shape[1:]) if shape else (1,))
    for k, lo, hi in _chunks(shape, first, last):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + k) % 2**63)
        chunk = start(lo, hi, generator) if start else torch.full((hi - lo, *shape[1:]), float("nan"))
        for write in recipe.writes:
            _apply(write, chunk, lo, hi, size, generator)
        a, b = max(lo, first), min(hi, last)
        out[a - first : b - first] = chunk[a - lo : b - lo]
    return out if shape else out.reshape(())
