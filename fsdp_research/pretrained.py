"""Weights in: a Hugging Face checkpoint (safetensors, one file or sharded with an index) into the (possibly
sharded) model, through transformers' own loading machinery: its conversion mapping for the family (key renames,
experts stored one by one and fused in the model, prefixes) and its shard-on-read, which reads only the region
of each tensor this rank's DTensor shard covers (and skips the experts it does not own), so a rank's memory stays
near its shard plus one block's tensors in flight.

Before anything is read, a dry run on the meta device (checkpoint tensors by shape only) checks that every
model tensor is found, that no checkpoint tensor is left over, and that every shape matches as a whole (a
shard-sized read could otherwise fill a shard from a smaller tensor without a word)."""

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from .errors import ConfigError
from .models import build_model

_FIX = "use a checkpoint of this model's architecture (model.name_or_path), without model.config overrides of shapes"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory: the ones its index lists (all of them must be there), or
    its one model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise ConfigError(
                "model.name_or_path",
                f"{path}'s index lists {', '.join(missing)}, which is not there",
                "download the checkpoint again, complete",
            )
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ConfigError(
            "model.name_or_path",
            f"{path} holds no model.safetensors(.index.json)",
            "point it at a directory written by save_pretrained (safetensors)",
        )
    return [single]


def _slices(files: list[str], handles: ExitStack, meta: bool) -> dict[str, Any]:
    """Every checkpoint tensor, unread: safetensors slices, or meta tensors of their shapes (for the dry run)."""
    state = {}
    for file in files:
        handle = handles.enter_context(safe_open(file, "pt"))
        for key in handle.keys():
            piece = handle.get_slice(key)
            state[key] = torch.empty(piece.get_shape(), device="meta") if meta else piece
    return state


def _load(model: nn.Module, files: list[str], device: str, meta: bool):
    """transformers' loading of the checkpoint into the model; returns its loading report. The family's conversion
    mapping is taken from an unwrapped twin: FSDP renames the classes it wraps (FSDPGPTNeoXForCausalLM), and
    transformers looks mappings up by class name."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    mapping = get_model_conversion_mapping(build_model(model.config))
    config = LoadStateDictConfig(weight_mapping=mapping, device_map={"": device})
    with ExitStack() as handles:
        info, _ = convert_and_load_state_dict_in_model(model, _slices(files, handles, meta), config)
    return info


def _first(keys, n: int = 3) -> str:
    keys = sorted(map(str, keys))
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def check_weights(hf_config, path: str) -> None:
    """The dry run: raises ConfigError for a checkpoint that does not fit the model the config builds."""
    model = build_model(hf_config)
    info = _load(model, checkpoint_files(path), "meta", meta=True)
    missing = set(info.missing_keys) - set(getattr(model, "all_tied_weights_keys", None) or {})
    if info.mismatched_keys:
        shapes = [
            f"{key} is {list(ours)} in the model, {list(theirs)} in the checkpoint"
            for key, theirs, ours in sorted(info.mismatched_keys)
        ][:3]
        raise ConfigError("model.config", f"{path} does not fit {type(model).__name__}: {'; '.join(shapes)}", _FIX)
    if missing or info.unexpected_keys or info.conversion_errors:
        parts = [
            f"missing {_first(missing)}" if missing else "",
            f"unexpected {_first(info.unexpected_keys)}" if info.unexpected_keys else "",
            f"not convertible {_first(info.conversion_errors)}" if info.conversion_errors else "",
        ]
        problem = f"{path} does not fit {type(model).__name__}: {'; '.join(p for p in parts if p)}"
        raise ConfigError("model.name_or_path", problem, _FIX)


def _registered(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str) -> None:
    """Fill the materialized model (checked first with check_weights) from the checkpoint in path."""
    # transformers sets each loaded tensor as a new Parameter; FSDP2 owns the parameter objects it sharded, so
    # each value is copied into the original, which goes back in its place.
    originals = list(_registered(model))
    _load(model, checkpoint_files(path), str(next(model.parameters()).device), meta=False)
    for module, name, original in originals:
        loaded = module._parameters[name]
        if loaded is not original:
            target = original.to_local() if isinstance(original, DTensor) else original
            target.copy_(loaded.to_local() if isinstance(loaded, DTensor) else loaded)
            module._parameters[name] = original
