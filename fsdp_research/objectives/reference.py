"""The reference model of DPO and GRPO's KL: the policy with its LoRA adapters switched off (no second model) or a
frozen copy sharded as the policy is (the initial weights, or a model directory's).

objective.reference=precompute: the reference model's log-probability of every document of the preference stores
(training and eval), summed over its targets, computed once before training and kept beside the store, so that the
reference is not held while training. Every rank computes its share of the windows (a collective); rank 0 writes
the table (<store>.reference-<key>.npy, atomically); a later start or a resume reads it. The key: the store, the
reference weights (their files' identity), the compute dtype and how documents are cut (seq_len, truncation): what
decides a document's log-probability. A table holds a float64 a document: O(documents) on every rank, as the
store's document index is."""

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, open_dict
from transformers import AutoConfig

from fsdp_research.data.packing import DOCUMENTS, IGNORE, LABELS, PairWindows
from fsdp_research.data.store_builder import write_atomic
from fsdp_research.distributed.processes import broadcast_object, on_rank0
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import build_hf_config, pretrained_dir
from fsdp_research.model.assembly import build_sharded_model
from fsdp_research.model.lora import enabled, lora_layers, saved_modules
from fsdp_research.model.pretrained import checkpoint_files, weights_identity
from fsdp_research.train.evaluation import rank_share
from fsdp_research.train.losses import token_losses

log = logging.getLogger("fsdp_research")


def check_directory(reference: str | None, keywords: tuple[str, ...], cfg: DictConfig) -> None:
    """objective.reference names one of `keywords` or a model directory save_pretrained wrote, of the policy's
    vocabulary (another's log-probabilities would be of other tokens)."""
    if reference in keywords:
        return
    if not isinstance(reference, str) or not os.path.isfile(os.path.join(reference, "config.json")):
        raise ConfigError(
            "objective.reference",
            f"{reference!r} is neither {', '.join(keywords)} nor a model directory (no config.json)",
            f"use {', '.join(keywords)}, or a directory save_pretrained wrote",
        )
    theirs, ours = AutoConfig.from_pretrained(reference).vocab_size, build_hf_config(cfg.model).vocab_size
    if theirs != ours:
        raise ConfigError(
            "objective.reference",
            f"{reference}: a vocabulary of {theirs} tokens, the policy's {ours}",
            "use the policy's family",
        )


def frozen_copy(cfg: DictConfig, device: torch.device, directory: str | None = None) -> nn.Module:
    """The reference as a frozen model of its own, sharded as the policy: the run's initial weights (a resume's
    too), or `directory`'s."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.model.lora.r = None
        if directory is not None:
            cfg.model.name_or_path, cfg.model.load_weights = directory, True
    copy, _ = build_sharded_model(cfg, build_hf_config(cfg.model), device, dist.get_world_size())
    return copy.requires_grad_(False).eval()


def reference_model(copy: nn.Module | None, policy: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """The reference: the frozen copy where there is one, else the policy with every adapter off."""
    return contextlib.nullcontext(copy) if copy is not None else adapters_off(policy)


@contextlib.contextmanager
def adapters_off(policy: nn.Module) -> Iterator[nn.Module]:
    """The policy with every adapter off (LoRA's layers and the trained copies of model.lora.modules_to_save: the
    base model), as PEFT's disable_adapter switches them."""
    adapted = [m for _, m in lora_layers(policy)] + [m for _, m in saved_modules(policy)]
    # PEFT's switch sets requires_grad on the adapters' parameters: put back as it was.
    trains = [(p, p.requires_grad) for m in adapted for p in m.parameters()]
    for module in adapted:
        module.enable_adapters(False)
    try:
        yield policy
    finally:
        for module in adapted:
            module.enable_adapters(True)
        for p, requires_grad in trains:
            p.requires_grad_(requires_grad)


def table_path(windows: PairWindows, cfg: DictConfig) -> str:
    """Where the reference's table of `windows`' store is kept, for this run's reference: the store's path, and of
    the reference its weights (their identity, and each file's path, size and time: two exports alike in the bytes
    the identity samples are two), its config as built (model.config's changes too), the compute dtype, LoRA's
    frozen copy's dtype and autocast under ddp_classic, and how documents are cut."""
    directory = pretrained_dir(cfg.model.name_or_path)
    files = [(os.path.realpath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in checkpoint_files(directory)]
    key = [
        weights_identity(directory),
        files,
        build_hf_config(cfg.model).to_json_string(),
        cfg.precision.param_dtype,
        enabled(cfg.model.lora),
        cfg.sharding.strategy,
        cfg.data.seq_len,
        cfg.data.truncation.value,
    ]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return f"{windows.store.path}.reference-{digest}.npy"


@torch.no_grad()
def compute_table(reference: nn.Module, windows: PairWindows, micro_batch: int, device: torch.device, amp, tp: int):
    """Each document's reference log-probability, summed over its targets ([documents], float64; 0 for those no
    window holds), each data-parallel rank its share of the windows (train.evaluation.rank_share). A collective."""
    index, weight = rank_share(windows.count, device, tp)
    table = torch.zeros(len(windows.first), dtype=torch.float64, device=device)
    for a in range(0, len(index), micro_batch):
        batch = torch.from_numpy(windows.read(index[a : a + micro_batch])).to(device)
        logps = -token_losses(reference, batch, amp).double() * weight[a : a + micro_batch, None]
        logps = logps * (batch[:, LABELS] != IGNORE)
        docs = batch[:, DOCUMENTS]
        table.index_add_(0, docs[docs >= 0], logps[docs >= 0])
    dist.all_reduce(table)
    return table / tp


def load_table(path: str, documents: int, device: torch.device) -> torch.Tensor | None:
    """The kept table where rank 0 can read it whole (its answer every rank's, so that all compute or none)."""

    def readable() -> bool:
        try:
            return len(np.load(path, mmap_mode="r")) == documents
        except (OSError, ValueError):
            return False

    return torch.from_numpy(np.load(path)).to(device) if broadcast_object(on_rank0(readable)) else None


def save_table(path: str, table: torch.Tensor) -> None:
    """Rank 0 keeps it (atomically); a store root it cannot write to (a shared, read-only one) is a warning: the
    table is then computed again at the next start."""
    try:
        if dist.get_rank() == 0:
            write_atomic(path, lambda f: np.save(f, table.cpu().numpy()), "wb")
    except OSError as err:
        log.warning(f"objective.reference=precompute: cannot keep {path} ({err}); the next start computes it again")
    finally:
        dist.barrier()
