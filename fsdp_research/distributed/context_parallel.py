"""Context parallel (parallel.cp): each sequence split over the cp ranks in 2 x cp chunks, rank r holding chunks r
and 2cp - 1 - r (a head and a tail chunk, so that a causal kernel's work per rank is even), with its tokens' true
positions for RoPE. All but attention works token by token and runs on the local chunks; attention gathers the whole
sequence for 1/cp of the heads with an all-to-all (Ulysses: works on gloo and NCCL alike), runs the family's own
attention function on it (causal, in order), and sends each rank its tokens back with all the heads.

The cp ranks hold the same parameters: they are the inner part of the shard dimension (`dp_shard x cp`), which FSDP
shards over and averages gradients over as over data-parallel ranks (each rank's loss is the mean over as many
tokens). Training's and evaluation's forwards split attention (ContextSplit.splitting), each rank its chunks of
the eval windows as of the training's; samples (generate) and the checks' forwards run the family's attention on
whole sequences."""

import contextlib
import functools
import sys

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from fsdp_research.errors import ConfigError

# The families' attention implementations split here (each called on the whole sequence's 1/cp of the heads).
SPLITTABLE = ("sdpa", "eager")
# What an attention function is told that the whole-sequence causal mask would drop.
_UNSPLIT_KWARGS = ("sliding_window", "softcap", "s_aux")


def chunk_order(cp: int) -> list[int]:
    """The 2 x cp chunks of a sequence in the order the cp ranks hold them: rank r has chunks r and 2cp - 1 - r."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def _positions(seq_len: int, cp: int, chunks, device: torch.device) -> torch.Tensor:
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks])


@functools.cache
def _gathered_order(seq_len: int, cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the positions of the gathered sequence's tokens: rank by rank, each rank's two chunks; the gathered index of
    each position): the same for every attention call of a run, made once."""
    order = _positions(seq_len, cp, chunk_order(cp), device)
    return order, torch.argsort(order)


class ContextSplit:
    """A cp group's split of the sequence: this rank's tokens, and the switch (`splitting`) under which the model's
    attention gathers the sequence over the group."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self.active = False

    def indices(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of this rank's tokens in a sequence of seq_len."""
        return _positions(seq_len, self.cp, (self.rank, 2 * self.cp - 1 - self.rank), device)

    def local(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, labels, position ids) of this rank's tokens of [batch, seq_len] inputs and labels."""
        index = self.indices(inputs.shape[1], inputs.device)
        return inputs[:, index], labels[:, index], index.expand(len(inputs), -1)

    @contextlib.contextmanager
    def splitting(self):
        """Attention split over the group: around a step's forwards and backwards (activation checkpointing's
        recomputation runs in backward)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, local tokens, dim] -> [batch, heads / cp, tokens, dim] of the whole sequence, in order:
        this rank keeps the cp-th part of the heads that is its rank."""
        b, h, s, d = x.shape
        parts = x.reshape(b, self.cp, h // self.cp, s, d).transpose(0, 1).contiguous()
        received = funcol.all_to_all_single_autograd(parts, None, None, self.group)
        whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)
        return whole[:, :, _gathered_order(self.cp * s, self.cp, x.device)[1]]

    def scatter_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, heads / cp, dim] in order -> [batch, local tokens, heads, dim]: the inverse of
        gather_sequence, on attention's output (transformers' functions return it tokens first)."""
        b, s, h, d = y.shape
        gathered = y[:, _gathered_order(s, self.cp, y.device)[0]]
        parts = gathered.reshape(b, self.cp, s // self.cp, h, d).transpose(0, 1).contiguous()
        received = funcol.all_to_all_single_autograd(parts, None, None, self.group)
        return received.permute(1, 2, 0, 3, 4).reshape(b, s // self.cp, self.cp * h, d)


def split_of(model: nn.Module) -> ContextSplit | None:
    """The model's context split (apply_cp), None without context parallel."""
    return getattr(model, "context_split", None)


def attention_of(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"


def unsplittable(config, seq_len: int) -> str | None:
    """What of a family's config (transformers') makes its attention other than causal over the whole sequence, which
    the split computes; None if nothing."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    found = [
        # Frequencies set from the largest position id a rank sees: each rank would rotate by its own.
        ("RoPE scaled by the sequence length (dynamic, longrope)", rope.get("rope_type") in ("dynamic", "longrope")),
        ("sliding-window layers", any(t != "full_attention" for t in getattr(config, "layer_types", None) or ())),
        (f"a sliding window of {window} tokens", isinstance(window, int) and window < seq_len),
        ("soft-capped attention scores", getattr(config, "attn_logit_softcapping", None) is not None),
    ]
    return next((what for what, present in found if present), None)


def check_cp(model: nn.Module, cp: int, tp: int, seq_len: int) -> None:
    """Raises ConfigError for a model whose attention cannot be split here (not transformers' attention interface,
    an implementation other than sdpa or eager, sliding windows shorter than the sequence, soft-capped scores,
    attention sinks), or heads that do not split over cp (per tp rank)."""
    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_attn_implementation", lambda: False)
    if config is None or not can_set():
        reason = f"{type(model).__name__}'s attention is not transformers' attention interface, which cp splits"
        raise ConfigError("parallel.cp", reason, "use parallel.cp=1")
    family = sys.modules[type(model).__module__]
    eager_unknown = attention_of(model) == "eager" and not hasattr(family, "eager_attention_forward")
    if attention_of(model) not in SPLITTABLE or eager_unknown:
        reason = f"attention {attention_of(model)!r} is not split here (only {', '.join(SPLITTABLE)})"
        raise ConfigError("parallel.cp", reason, "use parallel.cp=1, or model.config._attn_implementation=sdpa")
    what = unsplittable(config, seq_len) or (
        "attention sinks" if any(hasattr(m, "sinks") for m in model.modules()) else None
    )
    if what:
        raise ConfigError(
            "parallel.cp", f"{type(model).__name__} has {what}, which cp does not split", "use parallel.cp=1"
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or (heads // tp) % cp:
        reason = f"{cp} does not divide the {heads} attention heads" + (f" / tp {tp}" if tp > 1 else "")
        raise ConfigError("parallel.cp", reason, "use a divisor")


def apply_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """The model's attention implementation made the split one over the cp mesh (the family's implementation
    underneath; its masks as before), and the split kept on the model (split_of)."""
    split = ContextSplit(mesh.get_group(), mesh.size(), mesh.get_local_rank())
    original = attention_of(model)
    # The registry is global: a name of this split's own, so that another model's split does not take its place.
    name = f"context_parallel_{original}_{id(split)}"
    AttentionInterface.register(name, functools.partial(_attention, split, original))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.set_attn_implementation(name)
    model.context_split = split


def _family_attention(module: nn.Module, original: str):
    if original == "eager":  # each family's own, beside its attention module
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[original]


def _attention(split: ContextSplit, original: str, module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The family's attention; while splitting, on the whole sequence's 1/cp of the heads, causal."""
    attend = _family_attention(module, original)
    if not split.active:
        return attend(module, query, key, value, attention_mask, **kwargs)
    seq_len = query.shape[2] * split.cp
    window = kwargs.get("sliding_window")
    if any(kwargs.get(k) is not None for k in _UNSPLIT_KWARGS[1:]) or (window is not None and window < seq_len):
        reason = f"{type(module).__name__} asks for attention that cp does not split"
        raise ConfigError("parallel.cp", reason, "use parallel.cp=1")
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % split.cp:  # too few key-value heads to split: each query head's own copy
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    query, key, value = (split.gather_sequence(t) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    if original == "sdpa":
        mask, kwargs["is_causal"] = None, True
    else:
        mask = torch.full((seq_len, seq_len), torch.finfo(query.dtype).min, device=query.device).triu(1)[None, None]
    groups = getattr(module, "num_key_value_groups", None)
    if groups is not None:  # the query heads per key-value head, as gathered
        module.num_key_value_groups = query.shape[1] // key.shape[1]
    try:
        output, _ = attend(module, query, key, value, mask, **kwargs)
    finally:
        if groups is not None:
            module.num_key_value_groups = groups
    return split.scatter_sequence(output), None
