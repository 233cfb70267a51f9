"""Sampling: the samples of a step are a pure function of (seed, step), the same at any world size; every training
window once per epoch, reshuffled each epoch; a held-out set apart from training, fixed once; a mixture by weight;
no memory that grows with the corpus. Sources are stand-ins whose windows say which they are."""

import os
import sysconfig

import numpy as np
import pytest
import torch

from fsdp_research.data.parts import resolve_files
from fsdp_research.data.pipeline import Data, sources
from fsdp_research.data.sampling import BLOCK, Stream, apportion, permute
from fsdp_research.jobs.compose import compose

N, BATCH, LENGTH = 37, 12, 5  # a prime number of windows: batches straddle epoch boundaries


class Numbered:
    """`count` windows, each filled with (source id * 10**6 + its index), so a batch says what it holds."""

    def __init__(self, count: int, source: int = 0):
        self.count, self.length, self.source = count, LENGTH, source

    def read(self, index: np.ndarray) -> np.ndarray:
        return np.repeat((self.source * 10**6 + index)[:, None], LENGTH, axis=1).astype(np.int64)


def _data(count=N, seed=0, eval_fraction=0.0, weights=(1.0,)):
    windows = [Numbered(count, s) for s in range(len(weights))]
    return Data(Stream(windows, list(weights), seed, eval_fraction), LENGTH - 1)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 37, 64, 1000, 4097])
def test_permutation_is_a_bijection(n):
    out = permute(np.arange(n), n, seed=7)
    assert sorted(out.tolist()) == list(range(n))
    if n > 3:
        assert not np.array_equal(out, np.arange(n)) and not np.array_equal(out, permute(np.arange(n), n, 8))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 12])
def test_global_batch_is_the_same_whatever_the_world_size(world_size):
    data = _data(eval_fraction=0.1)
    for step in range(8):
        ranks = [data.rank_batch(step * BATCH, BATCH, rank, world_size) for rank in range(world_size)]
        assert all(len(r) == BATCH // world_size for r in ranks)
        assert torch.equal(torch.cat(ranks), data.global_batch(step, BATCH))


def test_deterministic_for_a_seed():
    for step in range(4):
        assert torch.equal(_data().global_batch(step, BATCH), _data().global_batch(step, BATCH))
    assert not torch.equal(_data(seed=1).global_batch(0, BATCH), _data().global_batch(0, BATCH))


def test_epochs_wrap_without_repeats_within_an_epoch():
    data, epochs = _data(), 3
    order = torch.cat([data.global_batch(step, BATCH)[:, 0] for step in range(epochs * N // BATCH + 1)])
    passes = [order[e * N : (e + 1) * N] for e in range(epochs)]
    for p in passes:
        assert sorted(p.tolist()) == list(range(N))  # every window exactly once per epoch
    assert not torch.equal(passes[0], passes[1])  # reshuffled each epoch


def test_held_out_windows_are_apart_and_fixed():
    data = _data(count=200, eval_fraction=0.05)
    held = data.batch(np.arange(10), held_out=True)[:, 0]
    assert len(set(held.tolist())) == 10  # 5% of 200
    trained = {int(x) for step in range(-(-190 // BATCH)) for x in data.global_batch(step, BATCH)[:, 0]}
    assert len(trained) == 190 and not trained & set(held.tolist())
    # The eval set depends on the seed and the data, nothing else.
    assert torch.equal(_data(count=200, eval_fraction=0.05).batch(np.arange(10), held_out=True)[:, 0], held)


def test_small_data_still_holds_out_one_window():
    data = _data(count=5, eval_fraction=0.05)
    assert [s.held_out for s in data.stream.splits] == [1]
    assert len({int(x) for x in data.batch(np.arange(4), held_out=True)[:, 0]}) == 1


def test_mixture_follows_the_weights_in_every_block():
    weights = (0.7, 0.2, 0.1)
    data = _data(count=10**6, weights=weights)
    source = (data.batch(np.arange(3 * BLOCK))[:, 0] // 10**6).numpy()
    for b in range(3):
        counts = np.bincount(source[b * BLOCK : (b + 1) * BLOCK], minlength=3)
        assert counts.tolist() == apportion(BLOCK, weights).tolist()
    # Interleaved, not in runs: the first batch of 64 already holds every source.
    assert set(source[:64].tolist()) == {0, 1, 2}


def test_each_source_of_a_mixture_is_an_epoch_without_repeats():
    data = _data(count=50, weights=(3.0, 1.0))
    samples = data.batch(np.arange(400))[:, 0].numpy()
    first = samples[samples < 10**6][:50]
    assert sorted(first.tolist()) == list(range(50))


def test_a_zero_weight_source_is_never_read():
    samples = _data(weights=(1.0, 0.0)).batch(np.arange(500))[:, 0]
    assert int(samples.max()) < 10**6


def test_no_memory_grows_with_the_corpus():
    """A trillion windows: sampling touches only the windows it reads."""
    data = _data(count=10**12, eval_fraction=0.01)
    batch = data.global_batch(10**9, BATCH)
    assert batch.shape == (BATCH, LENGTH) and int(batch.max()) < 10**12
    assert data.batch(np.arange(3), held_out=True).shape == (3, LENGTH)


def test_default_data_is_the_standard_library():
    cfg = compose([])
    assert cfg.data.kind.value == "local_text" and list(cfg.data.paths) == []
    [source] = sources(cfg.data)
    files = resolve_files(source.paths, source.key)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert os.path.join(stdlib, "os.py") in files and len(files) > 100
    assert all(os.path.dirname(f) == stdlib and f.endswith(".py") for f in files)
