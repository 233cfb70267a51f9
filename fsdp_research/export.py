"""Weights out: one Hugging Face directory (config.json, model.safetensors, sharded with an index above a
size, the tokenizer when one is used) that AutoModelForCausalLM.from_pretrained loads.

At the end of training the full weights are gathered once; `fsdp-research export <step dir> <out dir>`
converts any resume checkpoint offline, with no process group and no GPU."""

import json
import os
import re
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from .data.tokenizer import load_tokenizer
from .errors import ConfigError
from .models import clean_name
from .precision import parse_dtype

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(text).upper())
    if not match:
        raise ConfigError("checkpoint.export_shard_size", f"cannot read {text!r}", "use bytes, or e.g. 500MB, 5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def export_dtype(cfg: DictConfig) -> torch.dtype:
    """checkpoint.export_dtype, by default the training's compute dtype."""
    return parse_dtype(cfg.checkpoint.export_dtype or cfg.precision.param_dtype, "checkpoint.export_dtype")


def _tied_keys(hf_config) -> set:
    """Keys that alias another tensor (tied output embeddings): written once, as HF does."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return set()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return set(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)], "_tied_weights_keys", None) or {})


def write_hf_dir(
    state: dict[str, torch.Tensor],
    hf_config,
    out_dir: str,
    dtype: torch.dtype,
    shard_size: int,
    tokenizer: str | None = None,
) -> None:
    """Write full weights as a Hugging Face model directory."""
    os.makedirs(out_dir, exist_ok=True)
    tied = _tied_keys(hf_config)
    tensors = {clean_name(k): v.to(dtype).contiguous() for k, v in state.items() if clean_name(k) not in tied}
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if current and size + nbytes > shard_size:
            shards.append(current)
            current, size = {}, 0
        current[key], size = tensors[key], size + nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = hf_config.__class__.from_dict(hf_config.to_dict())
    hf_config.dtype = dtype
    hf_config.save_pretrained(out_dir)
    if tokenizer:
        load_tokenizer(tokenizer).save(out_dir)


def export_model(
    model: torch.nn.Module, hf_config, out_dir: str, dtype: torch.dtype, shard_size: int, tokenizer: str | None
) -> None:
    """Gather the full weights (a collective, every rank calls it) and write them from rank 0."""
    state = get_model_state_dict(
        getattr(model, "module", model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        write_hf_dir(state, hf_config, out_dir, dtype, shard_size, tokenizer)


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
