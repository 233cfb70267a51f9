"""Weights out: one Hugging Face directory (config.json, model.safetensors, sharded with an index above a
size, the tokenizer when one is used) that AutoModelForCausalLM.from_pretrained loads; for a model of one's own
(model._target_), its state_dict as safetensors (model.safetensors, or shards and an index), the tokenizer beside.

At the end of training the full weights are gathered once; `fsdp-research export <step dir> <out dir>`
converts any resume checkpoint offline, with no process group and no GPU."""

import logging
import os
import re
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .data.tokenizer import load_tokenizer
from .errors import ConfigError
from .models import build_model, clean_name
from .precision import fp32_names, parse_dtype

log = logging.getLogger("fsdp_research")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(text).upper())
    if not match:
        raise ConfigError("checkpoint.export_shard_size", f"cannot read {text!r}", "use bytes, or e.g. 500MB, 5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def export_dtype(cfg: DictConfig) -> torch.dtype:
    """checkpoint.export_dtype, by default the training's compute dtype."""
    return parse_dtype(cfg.checkpoint.export_dtype or cfg.precision.param_dtype, "checkpoint.export_dtype")


def write_hf_dir(
    state: dict[str, torch.Tensor],
    hf_config,
    out_dir: str,
    dtype: torch.dtype,
    shard_size: int,
    tokenizer: str | None = None,
) -> None:
    """Write full weights as the family's save_pretrained writes them: its on-disk key names and layout (the
    reverse of its load-time conversions, experts one by one where the checkpoint format has them so), tied
    weights once, sharded with an index above shard_size; and the tokenizer."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    twin = build_model(hf_config)  # on the meta device: save_pretrained only needs the family's conventions
    twin.config.dtype = dtype
    tied = set(getattr(twin, "all_tied_weights_keys", None) or {})
    # What from_pretrained keeps in fp32 at this dtype (router gates) is written in fp32, as its save_pretrained does.
    fp32 = fp32_names(twin, dtype)

    def cast(name: str, value: torch.Tensor) -> torch.Tensor:
        return value.to(torch.float32 if fp32 and fp32.search(name) else dtype).contiguous()

    tensors = {clean_name(k): cast(clean_name(k), v) for k, v in state.items() if clean_name(k) not in tied}
    twin.save_pretrained(out_dir, state_dict=tensors, max_shard_size=shard_size)
    if tokenizer:
        load_tokenizer(tokenizer).save(out_dir)


def write_state_dir(
    state: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype, shard_size: int, tokenizer: str | None = None
) -> None:
    """A model of one's own: its state_dict (wrapper names stripped) in safetensors files, every name with its
    own copy (tied weights too), so that model.load_state_dict(safetensors.torch.load_file(...)) takes it whole."""
    from huggingface_hub import save_torch_state_dict

    tensors, seen = {}, set()
    for name, value in state.items():
        value = value.to(dtype) if value.is_floating_point() else value
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        tensors[clean_name(name)] = value.clone() if key in seen else value
        seen.add(key)
    os.makedirs(out_dir, exist_ok=True)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.WARNING)  # not its "Model weights successfully saved" line: the run says where
    try:
        save_torch_state_dict(tensors, out_dir, max_shard_size=shard_size)
    finally:
        hub_log.setLevel(level)
    if tokenizer:
        load_tokenizer(tokenizer).save(out_dir)


def export_model(
    model: torch.nn.Module, hf_config, out_dir: str, dtype: torch.dtype, shard_size: int, tokenizer: str | None
) -> None:
    """Gather the full weights (a collective, every rank calls it) and write them from rank 0 (hf_config None:
    a model of one's own)."""
    state = get_model_state_dict(
        getattr(model, "module", model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        if hf_config is None:
            write_state_dir(state, out_dir, dtype, shard_size, tokenizer)
        else:
            write_hf_dir(state, hf_config, out_dir, dtype, shard_size, tokenizer)
        log.info(f"exported the weights to {out_dir}")


def load_checkpoint_weights(step_dir: str) -> dict[str, torch.Tensor]:
    """The full model weights of a resume checkpoint, read in this process alone."""
    metadata = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=step_dir, no_dist=True)
    return {k[len("model.") :]: v for k, v in state.items()}


if __name__ == "__main__":  # the old path, python -m fsdp_research.export
    from .cli import run_moved

    run_moved("fsdp_research.export", "export")
