"""Text -> tokens (datasets.map, cached) -> packed sequences -> a sample stream defined on the global step.
The samples of step s are the same whatever the world size; each rank takes its slice of them."""

import glob
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .config import DataConfig, DataKind
from .errors import ConfigError

BYTE_VOCAB = 257  # 256 byte values and an end-of-document token
_BYTE_EOS = 256


def resolve_paths(cfg: DataConfig) -> list[str]:
    patterns = list(cfg.paths) or [os.path.join(sysconfig.get_paths()["stdlib"], "*.py")]
    files = sorted({f for p in patterns for f in glob.glob(os.path.expanduser(p), recursive=True) if os.path.isfile(f)})
    if not files:
        raise ConfigError(
            "data.paths",
            f"{list(cfg.paths)} matches no file",
            "point data.paths at existing text files or globs (or leave it empty)",
        )
    return files


def build_tokenizer(name: str) -> tuple[Callable[[list[str]], list[list[int]]], int]:
    """(encode a batch of documents, each ending with an end-of-document token; vocabulary size)."""
    if name == "byte":
        return (lambda texts: [list(t.encode("utf-8")) + [_BYTE_EOS] for t in texts]), BYTE_VOCAB
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return (lambda texts: [ids + eos for ids in tok(texts, add_special_tokens=False)["input_ids"]]), len(tok)


def check_vocab(cfg: DataConfig, model_vocab: int) -> None:
    if cfg.kind is DataKind.synthetic:
        return
    _, vocab = build_tokenizer(cfg.tokenizer)
    if vocab > model_vocab:
        raise ConfigError(
            "data.tokenizer",
            f"{cfg.tokenizer!r} has {vocab} tokens, the model only {model_vocab}",
            "use a model with a larger vocab_size or a smaller tokenizer",
        )


def _load_texts(cfg: DataConfig):
    import datasets

    datasets.disable_progress_bars()
    if cfg.kind is DataKind.local_text:
        return datasets.load_dataset(
            "text", data_files=resolve_paths(cfg), sample_by="document", split="train", cache_dir=cfg.cache_dir
        )
    ds = datasets.load_dataset(
        cfg.hub_name, cfg.hub_config, split=cfg.split, streaming=cfg.streaming, cache_dir=cfg.cache_dir
    )
    if cfg.streaming:
        # A global-step-indexed stream needs random access: take a fixed prefix of the stream.
        ds = datasets.Dataset.from_list(list(ds.take(cfg.max_documents)))
    return ds.select_columns([cfg.text_field]).rename_column(cfg.text_field, "text")


def _pack(cfg: DataConfig) -> np.ndarray:
    encode, _ = build_tokenizer(cfg.tokenizer)
    row = cfg.seq_len + 1

    def tokenize_and_pack(batch):
        ids = np.concatenate([np.asarray(d, dtype=np.int32) for d in encode(batch["text"])])
        n = len(ids) // row
        return {"ids": ids[: n * row].reshape(n, row).tolist()}

    texts = _load_texts(cfg)
    packed = texts.map(tokenize_and_pack, batched=True, batch_size=256, remove_columns=texts.column_names)
    # Straight from the Arrow column: converting row by row costs seconds per rank.
    flat = packed.data.column("ids").combine_chunks().flatten().to_numpy()
    return flat.reshape(-1, row).astype(np.int64)


def _synthetic(cfg: DataConfig, vocab_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(cfg.num_sequences, cfg.seq_len + 1), dtype=np.int64)


@dataclass
class TokenStream:
    """Packed sequences of seq_len + 1 tokens (input and shifted target), sampled by global step."""

    sequences: torch.Tensor
    seed: int

    def __post_init__(self):
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.sequences), generator=gen)
        return self._perm

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The samples of global step `step` (0-based): a shuffled pass over the data, epoch after epoch."""
        n = len(self.sequences)
        index = [step * batch_size + i for i in range(batch_size)]
        return self.sequences[torch.stack([self._order(g // n)[g % n] for g in index])]

    def rank_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        per_rank = batch_size // world_size
        return self.global_batch(step, batch_size)[rank * per_rank : (rank + 1) * per_rank]


@dataclass
class Data:
    train: TokenStream
    eval: torch.Tensor  # held-out sequences, taken in order


def build_data(cfg: DataConfig, vocab_size: int, seed: int) -> Data:
    """Rank 0 tokenizes (datasets caches it); the other ranks then read the cache."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if cfg.kind is DataKind.synthetic:
        sequences = _synthetic(cfg, vocab_size, seed)
    else:
        if rank != 0:
            dist.barrier()
        sequences = _pack(cfg)
        if rank == 0 and dist.is_initialized():
            dist.barrier()
    # At least one held-out sequence when any is asked for: eval averages over them.
    n_eval = max(1, int(len(sequences) * cfg.eval_fraction)) if cfg.eval_fraction > 0 else 0
    if len(sequences) - n_eval < 1:
        raise ConfigError(
            "data",
            f"only {len(sequences)} sequences of {cfg.seq_len + 1} tokens",
            "add text (data.paths) or lower data.seq_len",
        )
    sequences = torch.from_numpy(sequences)
    return Data(TokenStream(sequences[: len(sequences) - n_eval], seed), sequences[len(sequences) - n_eval :])
