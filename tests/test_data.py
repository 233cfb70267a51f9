"""The sample stream is defined on the global step: the same samples whatever the world size, the same for a
seed, a fresh shuffle each epoch with no sample twice within one; the eval split is held out."""

import os
import sysconfig

import pytest
import torch

from fsdp_research.composition import compose
from fsdp_research.data import BYTE_VOCAB, TokenStream, build_data, resolve_paths
from tests.conftest import FAST, TEXT

N, BATCH = 37, 12  # a prime number of sequences: batches straddle epoch boundaries


def _numbered(n: int = N) -> torch.Tensor:
    """Sequences whose first token is their index, so a batch says which sequences it holds."""
    return torch.arange(n).unsqueeze(1).repeat(1, 5)


@pytest.fixture(scope="module")
def data():
    cfg = compose(FAST)
    return cfg, build_data(cfg.data, 512, seed=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 12])
def test_global_batch_is_the_same_whatever_the_world_size(data, world_size):
    _, built = data
    for step in range(8):
        ranks = [built.train.rank_batch(step, BATCH, rank, world_size) for rank in range(world_size)]
        assert all(len(r) == BATCH // world_size for r in ranks)
        assert torch.equal(torch.cat(ranks), built.train.global_batch(step, BATCH))


def test_deterministic_for_a_seed(data):
    cfg, built = data
    again = build_data(cfg.data, 512, seed=0)
    other_seed = build_data(cfg.data, 512, seed=1)
    assert torch.equal(again.train.sequences, built.train.sequences)
    for step in range(4):
        assert torch.equal(again.train.global_batch(step, BATCH), built.train.global_batch(step, BATCH))
    assert not torch.equal(other_seed.train.global_batch(0, BATCH), built.train.global_batch(0, BATCH))


def test_epochs_wrap_without_repeats_within_an_epoch():
    stream = TokenStream(_numbered(), seed=0)
    epochs = 3
    order = torch.cat([stream.global_batch(step, BATCH)[:, 0] for step in range(epochs * N // BATCH + 1)])
    passes = [order[e * N : (e + 1) * N] for e in range(epochs)]
    for p in passes:
        assert sorted(p.tolist()) == list(range(N))  # every sequence exactly once per epoch
    assert not torch.equal(passes[0], passes[1])  # reshuffled each epoch
    assert torch.equal(order[:N], TokenStream(_numbered(), seed=0).global_batch(0, N)[:, 0])


def test_packed_sequences_and_held_out_eval(data):
    cfg, built = data
    train, held_out = built.train.sequences, built.eval
    total = len(train) + len(held_out)
    assert len(held_out) == int(total * cfg.data.eval_fraction) > 0
    assert train.shape[1] == held_out.shape[1] == cfg.data.seq_len + 1
    assert 0 <= int(train.min()) and int(train.max()) < BYTE_VOCAB
    train_rows = {tuple(row) for row in train.tolist()}
    assert not any(tuple(row) in train_rows for row in held_out.tolist())


def test_small_data_still_holds_out_one_sequence():
    """5% of a few sequences rounds down to none; eval would then divide by zero at the end of training."""
    cfg = compose(["data.seq_len=500", f"data.paths=[{TEXT[0]}]"])
    built = build_data(cfg.data, 512, seed=0)
    assert len(built.eval) == 1 and int((len(built.train.sequences) + 1) * cfg.data.eval_fraction) == 0


def test_default_data_is_the_standard_library():
    cfg = compose([])
    assert cfg.data.kind.value == "local_text" and list(cfg.data.paths) == []
    files = resolve_paths(cfg.data)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert os.path.join(stdlib, "os.py") in files and len(files) > 100
    assert all(os.path.dirname(f) == stdlib and f.endswith(".py") for f in files)
