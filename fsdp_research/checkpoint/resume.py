"""Resume checkpoints found, verified and loaded: the published step dirs of a run, whether one is complete, and
its state loaded into this run's model, optimizer, callbacks and RNG (DCP reshards to this world size). The writing
side is checkpoint.dcp."""

import io
import json
import logging
import os
import random
import re
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fsdp_research.distributed.processes import new_threads_single_threaded
from fsdp_research.errors import CheckpointError
from fsdp_research.model.lora import lora_layers

log = logging.getLogger("fsdp_research")

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"


def state_options(model: torch.nn.Module, load: bool = False) -> StateDictOptions:
    """LoRA: the adapters alone (the frozen base is the pretrained checkpoint's; loaded not strict,
    load_checkpoint checks every key first). Else every weight."""
    if next(lora_layers(model), None) is None:
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=not load)


def is_step_dir(path: str) -> bool:
    """Whether path names a checkpoint (checkpoints/step_<N>) rather than a run dir."""
    return bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))


def checkpoints_in(root: str) -> list[tuple[int, str]]:
    """Published step dirs under root, newest first (not yet verified)."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    ]
    return sorted(found, reverse=True)


def verify(step_dir: str) -> str | None:
    """None when the checkpoint is complete and readable; otherwise what is wrong with it."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"no valid {MANIFEST} ({type(err).__name__})"
    for name, size in files.items():
        try:  # a file can go between two looks (the run pruning this checkpoint as another process reads it)
            actual = os.path.getsize(os.path.join(step_dir, name))
        except OSError:
            return f"missing {name}"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    try:
        dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as err:  # a garbled pickle can raise almost anything
        return f"unreadable DCP metadata ({type(err).__name__})"
    return None


def _set_rng_state(saved: bytes) -> None:
    state = torch.load(io.BytesIO(saved), weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _mismatches(saved_metadata: dict[str, Any], state: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Tensor keys that are missing, unexpected or of another shape between the checkpoint (its DCP metadata's
    state_dict_metadata) and this run: one list per kind, empty ones left out."""
    saved = {k: tuple(v.size) for k, v in saved_metadata.items() if hasattr(v, "size")}
    ours = {f"model.{k}": tuple(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")}
    ours.update(
        {
            f"optim.state.{fqn}.{name}": tuple(v.shape)
            for fqn, s in state["optim"]["state"].items()
            for name, v in s.items()
            if hasattr(v, "shape") and v.dim() > 0
        }
    )
    saved = {k: v for k, v in saved.items() if k.startswith("model.") or (k.startswith("optim.state.") and len(v) > 0)}
    missing = [f"missing {k}" for k in sorted(ours.keys() - saved.keys())]
    unexpected = [f"unexpected {k}" for k in sorted(saved.keys() - ours.keys())]
    reshaped = [
        f"{k} is {list(saved[k])} in the checkpoint, {list(ours[k])} here"
        for k in sorted(ours.keys() & saved.keys())
        if ours[k] != saved[k]
    ]
    return [kind for kind in (missing, unexpected, reshaped) if kind]


def load_checkpoint(
    step_dir: str,
    model: torch.nn.Module,
    optimizer,
    callbacks: dict[str, Any] | None = None,
    configured: Collection[str] = ("weight_decay", "betas", "eps"),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load model, optimizer, the callbacks' state (into callbacks: name -> state_dict, those the checkpoint
    has) and this rank's RNG state (DCP reshards to this world size); returns (the trainer state, the callbacks'
    loaded state). The group keys in `configured` keep the config's values. Checks every tensor key and shape
    first, so a mismatch changes nothing."""
    rank = dist.get_rank()
    model_state, optim_state = get_state_dict(model, optimizer, options=state_options(model))
    state = {"model": model_state, "optim": optim_state}
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    # Absent when resuming at a larger world size (and in checkpoints from before it was saved with DCP).
    rng = f"rng.rank_{rank}"
    if rng in saved:
        state["rng"] = {f"rank_{rank}": b""}
    kept = {n: v for n, v in (callbacks or {}).items() if any(k.startswith(f"callbacks.{n}.") for k in saved)}
    for name in sorted((callbacks or {}).keys() - kept.keys()):
        log.info(f"callback {name}: the checkpoint has no state of it, it starts afresh")
    if kept:
        state["callbacks"] = kept
    kinds = _mismatches(saved, state)
    if kinds:
        # A few of each kind: another optimizer shows as keys both missing and unexpected.
        shown = [problem for kind in kinds for problem in kind[:3]]
        more = sum(map(len, kinds)) - len(shown)
        raise CheckpointError(
            f"checkpoint {step_dir} does not fit this model/optimizer: {'; '.join(shown)}"
            + (f"; ... {more} more" if more else "")
        )
    with new_threads_single_threaded():
        dcp.load(state, checkpoint_id=step_dir)
    # The config's hyperparameters win over the checkpoint's (which DCP copies into the groups, and maps onto
    # the last group where the checkpoint has fewer); the learning rate is the schedule's.
    kept = [{k: g[k] for k in configured if k in g} for g in optimizer.param_groups]
    into = state_options(model, load=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=into)
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)
    old_rng = os.path.join(step_dir, f"rng_rank{rank}.pt")  # a checkpoint from before the states were in DCP
    if "rng" in state:
        _set_rng_state(state["rng"][f"rank_{rank}"])
    elif os.path.exists(old_rng):
        with open(old_rng, "rb") as f:
            _set_rng_state(f.read())
    log.info(f"resumed from checkpoint {step_dir}")
    return torch.load(os.path.join(step_dir, TRAINER_STATE), weights_only=False), state.get("callbacks", {})


def load_objective_state(step_dir: str, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The objective's state (Objective.state_dict(): tensors named and shaped as `template`) from step_dir's
    checkpoint; None where it has none (or none of those names and shapes: saved with other settings)."""
    if not template:
        return None
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    saved = {k: tuple(v.size) for k, v in saved.items() if k.startswith("objective.") and hasattr(v, "size")}
    if saved != {f"objective.{k}": tuple(v.shape) for k, v in template.items()}:
        return None
    state = {"objective": template}
    with new_threads_single_threaded():
        dcp.load(state, checkpoint_id=step_dir)
    return state["objective"]
