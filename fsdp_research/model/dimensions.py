"""A model's dimensions read from the model itself (its embeddings, its blocks' attention modules, its experts'
tensors), not from the config's attribute names, which every family spells its own way: what MFU, the planner,
the doctor and validation need of any family, dense, mixture of experts, latent attention (MLA), hybrid or
state-space. What cannot be read (a block without a recognisable attention) is named in `unknown`."""

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from fsdp_research.model.architecture import block_class_name, find_blocks, input_embedding, output_layer

# A module's attributes that hold its number of attention heads, its query/key and value head sizes (first found).
_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_QK_DIM = ("qk_head_dim", "head_dim", "head_size", "attention_head_size")
_V_DIM = ("v_head_dim", "head_dim", "head_size", "attention_head_size")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# Attention classes that mix tokens without a softmax over [T x T] scores (linear, lightning, delta-rule): their
# FLOPs are not attention's.
_LINEAR = re.compile(r"Linear|Lightning|Delta|Retention")
# Config attributes naming how many experts a token is routed to.
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k", "experts_per_token")


@dataclass(frozen=True)
class Attention:
    """One block's attention: heads, and the per-head sizes its score (q.k) and weighted-sum (.v) matmuls use."""

    heads: int
    qk_dim: int
    v_dim: int
    kv_heads: int


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    vocab: int
    # One entry per block: its attention, or None for a block without one (a state-space or linear-attention layer).
    attention: tuple[Attention | None, ...]
    intermediate: int
    # None where the family has no fixed limit.
    max_positions: int | None
    # Mixture of experts: experts per MoE layer and how many each token is routed to (0 and 0 for a dense model).
    experts: int = 0
    experts_per_token: int = 0
    # Block classes whose attention could not be read (their attention FLOPs are not counted).
    unknown: tuple[str, ...] = ()

    @property
    def layers(self) -> int:
        return len(self.attention)

    def _first(self) -> Attention:
        return next((a for a in self.attention if a), Attention(0, 0, 0, 0))

    # The first attention's shape: what the planner's per-block memory model takes for every block.
    @property
    def heads(self) -> int:
        return self._first().heads

    @property
    def head_dim(self) -> int:
        return self._first().qk_dim

    @property
    def kv_heads(self) -> int:
        return self._first().kv_heads


def _attr(objects: Sequence, names: Sequence[str]) -> int | None:
    for obj in objects:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _attention(block: nn.Module, hf_config) -> Attention | None:
    """The outermost module of an *Attention class in the block (not a norm), read from its own attributes first
    (per-layer shapes), then the config's."""
    for module in block.modules():
        name = type(module).__name__
        if "Attention" not in name or "Norm" in name or _LINEAR.search(name):
            continue
        sources = [module, getattr(module, "config", None) or hf_config]
        heads, qk = _attr(sources, _HEADS), _attr(sources, _QK_DIM)
        if qk is None and heads:
            hidden = _attr(sources, ("hidden_size", "embed_dim", "n_embd", "d_model"))
            qk = hidden // heads if hidden else None
        if not (heads and qk):
            continue
        v = _attr([module], ("v_head_dim",)) or _attr(sources, _V_DIM) or qk
        groups = _attr([module], ("num_key_value_groups",))
        kv = _attr(sources, _KV_HEADS) or (heads // groups if groups else heads)
        return Attention(heads, qk, v, kv)
    return None


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """A mixture of experts' routed experts, one entry per MoE layer: fused experts modules (MixtralExperts, ...;
    shared experts left out: every token passes through them) or lists of expert modules named `experts`."""
    found = []
    for path, module in model.named_modules():
        name = type(module).__name__
        fused = name.endswith("Experts") and "Shared" not in name and not isinstance(module, nn.ModuleList)
        if fused or (isinstance(module, nn.ModuleList) and path.rsplit(".", 1)[-1] == "experts"):
            found.append(module)
    return found


def _experts(model: nn.Module) -> int:
    """The experts of an MoE layer: the leading dimension of its fused experts tensors, or its list's length."""
    for module in expert_modules(model):
        if isinstance(module, nn.ModuleList):
            return len(module)
        params = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if params:
            return params[0].shape[0]
    return 0


def max_positions(hf_config) -> int | None:
    """The config's position limit; None where it has none (or says -1, as XLNet's does)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "context_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def dims(model: nn.Module, block_paths: Sequence[str] | None = None) -> ModelDims:
    """The dimensions of a model (on the meta device or materialized; before sharding, which renames classes)
    and its repeating blocks (their paths, as the sharding plan has them; by default found as the trainer finds
    them, without model.block_class)."""
    hf_config = getattr(model, "config", None)  # None for a model of one's own
    if block_paths is None:
        blocks = find_blocks(model, block_class_name(model, None))
    else:
        blocks = [model.get_submodule(path) for path in block_paths]
    blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in blocks]
    embedding, output = input_embedding(model), output_layer(model)
    hidden = getattr(embedding, "embedding_dim", None) or _attr([hf_config], ("hidden_size", "n_embd", "d_model"))
    if output is not None and hasattr(output, "weight"):
        vocab = output.weight.shape[0]
    else:
        vocab = getattr(hf_config, "vocab_size", None) or getattr(embedding, "num_embeddings", 0)
    attention = tuple(_attention(block, hf_config) for block in blocks)
    unknown = sorted({type(b).__name__ for b, a in zip(blocks, attention) if a is None})
    experts = _experts(model)
    intermediate = _attr([hf_config], ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")) or 4 * hidden
    return ModelDims(
        hidden=hidden,
        vocab=vocab,
        attention=attention,
        intermediate=intermediate,
        max_positions=max_positions(hf_config),
        experts=experts,
        experts_per_token=(_attr([hf_config], _TOP_K) or 1) if experts else 0,
        unknown=tuple(unknown),
    )
