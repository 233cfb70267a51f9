"""Which parameters Muon orthogonalizes, and as which matrices: the one classification that the optimizer's build
and the planner share. Inside the repeating blocks, every weight matrix but a router's: fused projections as their
logical matrices (q/k/v by the config's head counts, gate/up by halves), Conv1D's (in, out) weights transposed,
expert tensors [E, out, in] one matrix per expert. Everything else (embeddings, norms, biases, routers, the output
head) goes to optim.others."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers.pytorch_utils import Conv1D

from fsdp_research.distributed.names import clean_name
from fsdp_research.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """How a stored tensor holds the matrices Newton-Schulz sees: its last two dims are (out, in), or (in, out)
    when transposed (Conv1D, transposed experts); leading dims (experts) are a batch; the out rows are `groups`
    repeats of `sizes` consecutive rows, one size per logical matrix (none: the tensor is one matrix)."""

    transposed: bool = False
    sizes: tuple[int, ...] = ()
    groups: int = 1


def pieces(x: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """The logical matrices of a stored tensor, each [..., rows, in] (copies where the rows interleave)."""
    x = x.mT if layout.transposed else x
    if not layout.sizes:
        return [x]
    *lead, rows, cols = x.shape
    grouped = x.reshape(*lead, layout.groups, rows // layout.groups, cols)
    return [piece.reshape(*lead, -1, cols) for piece in grouped.split(layout.sizes, dim=-2)]


def assembled(parts: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The stored tensor of its logical matrices (pieces' inverse)."""
    x = parts[0]
    if layout.sizes:
        *lead, _, cols = x.shape
        grouped = [part.reshape(*lead, layout.groups, -1, cols) for part in parts]
        x = torch.cat(grouped, dim=-2).reshape(*lead, -1, cols)
    return x.mT if layout.transposed else x


def matrix_shapes(shape: Sequence[int], layout: Layout) -> list[tuple[int, int]]:
    """(rows, cols) of each logical matrix (one expert's)."""
    rows, cols = (shape[-1], shape[-2]) if layout.transposed else (shape[-2], shape[-1])
    return [(layout.groups * size, cols) for size in layout.sizes] or [(rows, cols)]


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _qkv(c, rows: int, module: nn.Module) -> tuple[int, tuple[int, ...]]:
    # q, then k and v of the key-value heads (GQA): Phi-3's qkv_proj, GPT-2's c_attn.
    d, kv = _head_dim(c), getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 1, (c.num_attention_heads * d, kv * d, kv * d)


def _gate_up(c, rows: int, module: nn.Module) -> tuple[int, tuple[int, ...]]:
    # [gate; up] halves; transformers' interleaved experts (is_concatenated false, gpt-oss) alternate rows.
    if getattr(module, "is_concatenated", True):
        return 1, (rows // 2, rows // 2)
    return rows // 2, (1, 1)


# Fused projections by name: (groups, sizes) of their out rows, from the model's config.
FUSED = {
    "qkv_proj": _qkv,
    "c_attn": _qkv,
    "gate_up_proj": _gate_up,
    # GPT-NeoX: q, k, v per head.
    "query_key_value": lambda c, rows, module: (c.num_attention_heads, (_head_dim(c),) * 3),
    # DeepSeek's latent attention: the kv latent and the shared rope key; per head, k's nope part and v.
    "kv_a_proj_with_mqa": lambda c, rows, module: (1, (c.kv_lora_rank, c.qk_rope_head_dim)),
    "kv_b_proj": lambda c, rows, module: (c.num_attention_heads, (c.qk_nope_head_dim, c.v_head_dim)),
}


def _module_name(name: str) -> str:
    """The last component of a parameter's module path (lm_head.weight: lm_head)."""
    return name.rpartition(".")[0].rpartition(".")[2] or name


def layout_of(name: str, p: torch.Tensor, module: nn.Module, config) -> Layout:
    """The layout of a matrix Muon takes; a fused projection's split checked against its rows."""
    transposed = isinstance(module, Conv1D) or (p.ndim > 2 and getattr(module, "is_transposed", False))
    leaf = name.rsplit(".", 1)[-1]
    fused = FUSED.get(_module_name(name) if leaf == "weight" else leaf)
    if fused is None or config is None:
        return Layout(transposed)
    rows = p.shape[-1] if transposed else p.shape[-2]
    groups, sizes = fused(config, rows, module)
    if groups * sum(sizes) != rows:
        raise ConfigError(
            "optim._target_",
            f"{name} has {rows} rows, not the {groups} x {sum(sizes)} of its fused layout from the model's config",
            "use optim=adamw for this model (Muon cannot split its fused projection)",
        )
    return Layout(transposed, tuple(sizes), groups)


@dataclass(frozen=True)
class Matrix:
    """One tensor Muon takes: its layout, its (global) shape and bytes."""

    layout: Layout
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class MuonSplit:
    """matrices: by parameter name (as in the state dict), what Muon takes; others: the rest, name -> kind."""

    matrices: dict[str, Matrix]
    others: dict[str, str]

    @property
    def params(self) -> int:
        return sum(math.prod(m.shape) for m in self.matrices.values())

    @property
    def exchanged(self) -> int:
        """Elements of the 2-D matrices, which the owner gathers whole; an expert tensor's shards hold whole
        experts, orthogonalized where they are."""
        return sum(math.prod(m.shape) for m in self.matrices.values() if len(m.shape) == 2)


def _num_experts(config) -> int:
    counts = (getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    return next((n for n in counts if isinstance(n, int)), 0)


def _other_kind(name: str, p: torch.Tensor, module: nn.Module, in_block: bool, router: tuple) -> str | None:
    """What a parameter optim.others takes is, or None for one of Muon's matrices."""
    if name.endswith("bias"):
        return "biases"
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if p.ndim < 2:
        return "norms"
    if not in_block:
        return _module_name(name)  # lm_head
    # One row per expert: the logits the top-k picks from, not a projection.
    return "routers" if tuple(p.shape) == router else None


def muon_split(model: nn.Module, block_paths: Sequence[str]) -> MuonSplit:
    """Muon's matrices and the rest (optim.others) of a model whose repeating blocks are at block_paths."""
    config = getattr(model, "config", None)
    router = (_num_experts(config), getattr(config, "hidden_size", 0)) if config is not None else ()
    inside = {id(p) for path in block_paths for p in model.get_submodule(path).parameters()}
    matrices, others = {}, {}
    for raw, p in model.named_parameters():
        name, module = clean_name(raw), model.get_submodule(raw.rpartition(".")[0])
        kind = _other_kind(name, p, module, id(p) in inside, router)
        if kind is None:
            matrices[name] = Matrix(layout_of(name, p, module, config), tuple(p.shape), p.numel() * p.element_size())
        else:
            others[name] = kind
    return MuonSplit(matrices, others)


def describe(split: MuonSplit, main_target: str, rest_target: str) -> str:
    """One line: what each optimizer (optim._target_, optim.others._target_) takes: the start-up log's and the
    plan's."""
    main, rest = (str(target).rsplit(".", 1)[-1] for target in (main_target, rest_target))
    count = sum(math.prod(m.shape[:-2]) * len(matrix_shapes(m.shape, m.layout)) for m in split.matrices.values())
    notes = {
        "fused projections split": sum(bool(m.layout.sizes) for m in split.matrices.values()),
        "expert tensors per expert": sum(len(m.shape) > 2 for m in split.matrices.values()),
        "transposed": sum(m.layout.transposed for m in split.matrices.values()),
    }
    said = ", ".join(f"{n} {what}" for what, n in notes.items() if n)
    mib = sum(m.nbytes for m in split.matrices.values()) / 2**20
    kinds = ", ".join(dict.fromkeys(split.others.values())) or "nothing"
    return (
        f"{main}: {len(split.matrices)} tensors ({split.params:,} params, {mib:.3g} MiB) as {count} matrices"
        + (f" ({said})" if said else "")
        + f"; others ({rest}): {kinds}"
    )
