"""Memory and communication planner: per-rank memory and per-step traffic of a config, without allocating the
model (it is built on the meta device, wrapped for activation checkpointing and planned as the trainer does).

    python -m fsdp_research.plan <overrides...> world_size=N [--compare] [--device cpu|cuda]

Everything below is a pure function of a ModelSummary (each FSDP unit's parameter shapes, from the plan; the block
shapes, from the HF config) and a Run (world size, dtypes, batch). Bytes per rank; e = compute bytes
(precision.param_dtype), r = reduce bytes, h = hidden, i = intermediate, a = heads, V = vocab, n = the shard
group (world_size, or world_size / replicate for hsdp). tests/test_plan.py checks it against torch's FSDP memory
tracker.

State: parameters fp32 (FSDP2 pads each dim 0 to a multiple of n), gradients the same (FSDP2 keeps sharded
gradients in the sharded parameter's dtype), AdamW 2 x fp32. ddp replicates all three, holds its gradients twice
(param.grad and DDP's flat all-reduce buckets), and its autocast saves a compute-dtype copy of every weight.

Activations saved per token by a llama block (HF's LlamaDecoderLayer with SDPA; enumerated from the tensors
autograd saves):
    2 RMSNorms x (4h [fp32 copy of the input; the input itself when e=4] + e*h [normalized] + e*h [scaled output]
                  + 4 [rsqrt])
  + attention: e*(2h + 2*kv_dim) [rotated q and k, v, output] + 4a [logsumexp]
  + SwiGLU MLP: 4*e*i [gate, silu(gate), up, their product]
Eager attention adds (4 + e)*a*s per token (the softmax in fp32 and its cast), which SDPA never materializes. This
is Korthikanti et al.'s s*b*h*(34 + 5*a*s/h) at 16 bits, redone for llama: a gated MLP of width i instead of 4h,
RMSNorm upcasts instead of dropout masks, no attention matrix; other architectures get Korthikanti's 34*h*e/2.
Above the blocks: the final norm and the fp32 log-probabilities of the loss (4V). A checkpointed block keeps only
its input (e*h) and recomputes the rest in backward, one block at a time: about +33% of that block's compute (a
forward is a third of forward + backward), so checkpointing every k-th block costs about +33%/k.

Backward temporaries per token: 8V of fp32 loss gradients as backward starts; within a block the incoming gradient
(e*h) plus, in the MLP, the gradients of gate, up and their product (3*e*i, once the down projection has released
its input), then max(attention: e*(2h + 2*kv_dim), RMSNorm: 2 fp32 h-wide tensors, or 4 and one e*h when it
upcasts from 16 bits); plus the parameter gradients autograd holds until FSDP takes them.

Parameters gathered in flight (compute dtype): the root's own (embeddings, final norm, lm_head), the current unit
and the next (the backward prefetch; in forward the all-gather buffer FSDP2 keeps until the next all-gather), and
every unit that skipped resharding after forward (the resident last block; all blocks for no_reshard; the whole
model for root_only; single Linears for per_linear). Gradients unsharded in flight: one unit's in the compute dtype
with its reduce-scatter input in the reduce dtype (FSDP2 keeps that input until the next unit's reduction); with
gradient accumulation and defer_grad_sync, every unit's accumulated gradients (reduce dtype), unsharded.

The peak is the largest total over the moments where memory can peak: the end of forward, the start of backward,
the MLP and attention parts and the reduction of each block's backward, the root's reduction, and the optimizer
step (AdamW's foreach implementation on CUDA holds one sharded-parameters-sized temporary; the per-tensor loop on
CPU, two of the largest shard).

Communication per rank per step: what each rank receives, (n-1)/n of each collective's payload. All-gather: every
unit in forward and every unit that resharded again in backward, per micro-batch, in the compute dtype.
Reduce-scatter: every unit's gradients in the reduce dtype, once per step with defer_grad_sync (else per
micro-batch). hsdp adds an all-reduce of the gradient shards across replicas; ddp all-reduces fp32 gradients.
"""
import argparse
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from .config import ConfigError, Strategy, compose
from .distributed import device_for, planned_world_size
from .models import build_hf_config
from .precision import dtype
from .sharding import ShardingPlan, planned_model

GIB = 2**30
FP32 = 4
# Same block as HF's Llama: RMSNorm, rotary SDPA attention, SwiGLU MLP.
LLAMA_LIKE = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class UnitSize:
    """One FSDP unit: the parameters it owns, as (dim 0, elements per dim-0 row), in forward order."""

    path: str
    shapes: Tuple[Tuple[int, int], ...]
    reshard_after_forward: bool
    # The block it lies in; None for the root.
    block: Optional[int]

    @property
    def numel(self) -> int:
        return sum(rows * row for rows, row in self.shapes)

    def shard_numel(self, n: int) -> int:
        return sum(-(-rows // n) * row for rows, row in self.shapes)


@dataclass(frozen=True)
class ModelSummary:
    """What the memory model needs of a model and its plan: parameter shapes per unit, block shapes."""

    name: str
    model_type: str
    n_params: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int
    vocab: int
    n_blocks: int
    sdpa: bool
    strategy: Strategy
    checkpointed: Tuple[bool, ...]
    # The units below the root, in forward order (none for root_only and ddp).
    units: Tuple[UnitSize, ...]
    # What the root unit owns (ddp: the whole model).
    root: UnitSize
    # Root-owned elements inside each block (norms under per_linear, whole blocks under root_only).
    root_in_block: Tuple[int, ...]
    # The input embedding when untied: its gradient only appears at the very end of backward.
    input_embedding: int


@dataclass(frozen=True)
class Run:
    world_size: int
    # precision.param_dtype and reduce_dtype, as named in the config.
    compute_dtype: str
    reduce_dtype: str
    shard_group: int
    replicas: int
    compute_bytes: int
    reduce_bytes: int
    micro_batch: int
    seq_len: int
    micro_steps: int
    defer_grad_sync: bool
    cpu_offload: bool
    # AdamW's foreach implementation (CUDA) instead of the per-tensor loop (CPU).
    foreach: bool

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class Memory:
    """Per-rank bytes: each entry is that category's peak over the step; `peak` is the largest total."""

    sharded_params: int
    sharded_grads: int
    optimizer: int
    gathered: int
    unsharded_grads: int
    activations: int
    temporaries: int
    peak: int
    peak_at: str
    # Sharded state kept in host memory by sharding.cpu_offload (not in `peak`).
    host: int


@dataclass(frozen=True)
class Traffic:
    """Per-rank bytes received per step."""

    all_gather: int
    # The part of all_gather that regathers resharded units in backward.
    all_gather_backward: int
    reduce_scatter: int
    all_reduce: int


def summarize(cfg: DictConfig, model: nn.Module, plan: ShardingPlan, hf_config) -> ModelSummary:
    """The plan's units with the parameter shapes each one owns (a unit owns what no deeper unit owns)."""
    paths = [u.path for u in plan.units] or [""]
    owned: Dict[str, List[Tuple[str, Tuple[int, int]]]] = {p: [] for p in paths}
    for name, param in model.named_parameters():
        owner = max((p for p in paths if p == "" or name.startswith(p + ".")), key=len)
        owned[owner].append((name, (param.shape[0], param[0].numel()) if param.dim() else (1, 1)))

    def block_of(name: str) -> Optional[int]:
        return next((i for i, b in enumerate(plan.blocks) if name == b or name.startswith(b + ".")), None)

    flags = {u.path: u.reshard_after_forward for u in plan.units}
    units = tuple(UnitSize(p, tuple(s for _, s in owned[p]), flags.get(p, False), block_of(p) if p else None)
                  for p in paths)
    root_in_block = [0] * len(plan.blocks)
    for name, (rows, row) in owned[""]:
        if block_of(name) is not None:
            root_in_block[block_of(name)] += rows * row
    embedding = model.get_input_embeddings().weight
    tied = any(p is embedding for p in model.get_output_embeddings().parameters())
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    return ModelSummary(
        name=cfg.model.name, model_type=hf_config.model_type, n_params=sum(p.numel() for p in model.parameters()),
        hidden=h, intermediate=getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "n_inner", None)
        or 4 * h, heads=heads, kv_dim=(getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim,
        vocab=hf_config.vocab_size, n_blocks=len(plan.blocks), sdpa=model.config._attn_implementation != "eager",
        strategy=plan.strategy,
        checkpointed=tuple(isinstance(model.get_submodule(b), CheckpointWrapper) for b in plan.blocks),
        units=units[:-1] if plan.units else (), root=units[-1], root_in_block=tuple(root_in_block),
        input_embedding=0 if tied else embedding.numel())


def run_settings(cfg: DictConfig, world_size: int, device_type: str) -> Run:
    strategy = Strategy(cfg.sharding.strategy)
    replicas = cfg.sharding.replicate if strategy is Strategy.hsdp else 1
    t = cfg.trainer
    return Run(world_size=world_size, compute_dtype=cfg.precision.param_dtype,
               reduce_dtype=cfg.precision.reduce_dtype,
               shard_group=1 if strategy is Strategy.ddp else world_size // replicas,
               replicas=replicas, compute_bytes=dtype(cfg.precision.param_dtype, "precision.param_dtype").itemsize,
               reduce_bytes=dtype(cfg.precision.reduce_dtype, "precision.reduce_dtype").itemsize,
               micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len,
               micro_steps=t.global_batch_size // (t.micro_batch_size * world_size),
               defer_grad_sync=t.defer_grad_sync, cpu_offload=cfg.sharding.cpu_offload,
               foreach=device_type == "cuda" and not cfg.sharding.cpu_offload)


# Activations, per token (bytes); see the module docstring.

def _norm_bytes(m: ModelSummary, e: int) -> int:
    return FP32 * m.hidden + 2 * e * m.hidden + FP32


def block_activation_bytes(m: ModelSummary, e: int, seq_len: int) -> int:
    """What one block saves for backward, per token."""
    scores = 0 if m.sdpa else (FP32 + e) * m.heads * seq_len
    if m.model_type not in LLAMA_LIKE:
        return 34 * m.hidden * e // 2 + scores
    attention = e * (2 * m.hidden + 2 * m.kv_dim) + FP32 * m.heads
    return 2 * _norm_bytes(m, e) + attention + 4 * e * m.intermediate + scores


def saved_activations(m: ModelSummary, e: int, seq_len: int, checkpointed: Sequence[bool]) -> List[int]:
    """Per token, what each block holds between its forward and its backward."""
    full = block_activation_bytes(m, e, seq_len)
    return [e * m.hidden if ckpt else full for ckpt in checkpointed]


def _norm_backward_bytes(m: ModelSummary, e: int) -> int:
    """RMSNorm's backward runs in fp32: two fp32 temporaries of width h when computing in fp32, four and one in
    the compute dtype when it upcasts from 16 bits."""
    return 2 * FP32 * m.hidden if e == FP32 else 4 * FP32 * m.hidden + e * m.hidden


def _mlp_saved_bytes(m: ModelSummary, e: int) -> int:
    return 4 * e * m.intermediate if m.model_type in LLAMA_LIKE else 0


def _logits_forward(m: ModelSummary, e: int) -> int:
    """At the loss: the logits in the compute dtype, their fp32 copy (the same tensor when e=4), the log-probs."""
    return m.vocab * (2 * FP32 + (e if e != FP32 else 0))


# Memory.

@dataclass(frozen=True)
class _Phases:
    """Activations and backward temporaries (bytes per micro-batch) where memory can peak."""

    forward_end: int  # at the loss: every block's saved tensors, the final norm's, the logits
    root_forward_end: int  # inside the root's forward, logits in the compute dtype only
    backward_start: int  # saved tensors with the fp32 log-probs...
    loss_grads: int  # ...and the fp32 loss gradients
    # Backward of block k: [(moment, activations, temporaries, the block's parameter gradients autograd holds:
    # up to this many elements, all of them (None), or none (0: FSDP took them for its reduce-scatter))].
    block: List[List[Tuple[str, int, int, Optional[int]]]]


def _phases(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> _Phases:
    e, tok, h = run.compute_bytes, run.tokens, m.hidden
    saved = [a * tok for a in saved_activations(m, e, run.seq_len, checkpointed)]
    full_block = block_activation_bytes(m, e, run.seq_len) * tok
    norm = _norm_bytes(m, e) * tok
    incoming = e * h * tok  # the gradient flowing down the residual stream

    def inside(k: int) -> List[Tuple[str, int, int, Optional[int]]]:
        # A block's own activations are all there as its backward starts (recomputed when checkpointed). The MLP
        # goes first: its peak holds the gradients of gate, up and their product, once the down projection's
        # backward has released its input. Then the norms and attention.
        mlp_peak = full_block - _mlp_saved_bytes(m, e) * tok // 4  # the product: one of the MLP's four
        return [("MLP", sum(saved[:k]) + mlp_peak, incoming + 3 * e * m.intermediate * tok, h * m.intermediate),
                ("attention", sum(saved[:k]) + full_block - _mlp_saved_bytes(m, e) * tok,
                 incoming + max(_norm_backward_bytes(m, e), e * (2 * h + 2 * m.kv_dim)) * tok, None),
                ("reduction", sum(saved[:k]), incoming, 0)]

    return _Phases(
        forward_end=sum(saved) + norm + _logits_forward(m, e) * tok,
        root_forward_end=sum(saved) + norm + e * m.vocab * tok,
        backward_start=sum(saved) + norm + FP32 * m.vocab * tok,
        loss_grads=2 * FP32 * m.vocab * tok,
        block=[inside(k) for k in range(m.n_blocks)])


def _step_temporaries(units: Sequence[UnitSize], run: Run) -> int:
    if run.foreach:
        return FP32 * sum(u.shard_numel(run.shard_group) for u in units)
    return 2 * FP32 * max(-(-rows // run.shard_group) * row for u in units for rows, row in u.shapes)


def _fsdp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> List[Tuple[str, Dict[str, int]]]:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    units, every = list(m.units), [*m.units, m.root]
    phases = _phases(m, run, checkpointed)
    shards = FP32 * sum(u.shard_numel(n) for u in every)
    accumulating = run.micro_steps > 1
    # Earlier micro-batches' gradients: reduced into the shards, or (deferred) kept unsharded in the reduce dtype.
    sharded_before = accumulating and not run.defer_grad_sync
    deferred = r * sum(u.numel for u in every) if accumulating and run.defer_grad_sync else 0

    def state(done: Sequence[UnitSize]) -> Dict[str, int]:
        grads = shards if sharded_before else FP32 * sum(u.shard_numel(n) for u in done)
        return dict(params=shards, optimizer=2 * shards, grads=grads)

    def resident(before: int) -> int:
        return e * sum(u.numel for u in units[:before] if not u.reshard_after_forward)

    root, kept = e * m.root.numel, resident(len(units))
    # The last all-gather's buffer is kept until the root's forward ends: the last unit's, or the root's own.
    last_gathered = e * (units[-1].numel if units else m.root.numel)
    moments = [
        ("end of the root's forward", dict(state([]), gathered=root + kept + last_gathered, unsharded_grads=deferred,
                                           activations=phases.root_forward_end)),
        ("end of forward", dict(state([]), gathered=root + kept, unsharded_grads=deferred,
                                activations=phases.forward_end)),
        ("start of backward", dict(state([]), gathered=root + kept, unsharded_grads=deferred,
                                   activations=phases.backward_start, temporaries=phases.loss_grads)),
    ]
    # Backward, block by block: the block's largest unit is the one in flight (per_linear: a Linear; root_only:
    # none, the block's gradients are the root's).
    for k in reversed(range(m.n_blocks)):
        inside = [j for j, u in enumerate(units) if u.block == k]
        j = max(inside, key=lambda i: units[i].numel) if inside else None
        unit = units[j].numel if j is not None else 0
        prefetch = units[j - 1].numel if j and units[j - 1].reshard_after_forward else 0
        # FSDP2 keeps the previous unit's reduce-scatter input until this unit's reduction starts.
        previous = units[j + 1].numel if j is not None and j + 1 < len(units) else 0
        # The root's gradients stay unsharded until its reduction at the very end of backward; the input
        # embedding's is computed last.
        root_grads = e * (m.root.numel - m.input_embedding - sum(m.root_in_block[:k]))
        for moment, activations, temporaries, held in phases.block[k]:
            reducing = held == 0
            if reducing and j is None:
                continue
            moments.append((f"backward of block {k} ({moment})", dict(
                state(units[j + 1:] if j is not None else []),
                gathered=root + resident(j or 0) + e * (unit + prefetch),
                # Autograd holds a unit's gradients until FSDP takes them for its reduce-scatter.
                unsharded_grads=deferred + ((e + r) * unit if reducing else r * previous),
                activations=activations,
                temporaries=temporaries + root_grads + e * (unit if held is None else min(held, unit)))))
    moments.append(("the root's gradient reduction", dict(
        state(units), gathered=root,
        unsharded_grads=deferred + (e + r) * m.root.numel)))
    moments.append(("optimizer step", dict(state(every), temporaries=_step_temporaries(every, run))))
    if run.cpu_offload:
        for _, parts in moments:
            parts["host"] = parts.pop("params") + parts.pop("optimizer") + parts.pop("grads")
    return moments


def _ddp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> List[Tuple[str, Dict[str, int]]]:
    """Replicated fp32 parameters, gradients (param.grad, and DDP's flat buckets for the whole run) and AdamW
    state. Under autocast each weight's compute-dtype copy is saved for backward: a model's worth, held from
    forward to backward."""
    phases = _phases(m, run, checkpointed)
    params = FP32 * m.n_params
    casts = m.n_params * run.compute_bytes if run.compute_bytes != FP32 else 0
    before = params if run.micro_steps > 1 else 0

    def state(grads: int) -> Dict[str, int]:
        return dict(params=params, optimizer=2 * params, grads=params + max(before, grads))

    top = FP32 * (m.root.numel - sum(m.root_in_block))
    moments = [("end of forward", dict(state(0), gathered=casts, activations=phases.forward_end)),
               ("start of backward", dict(state(0), gathered=casts, activations=phases.backward_start,
                                          temporaries=phases.loss_grads))]
    for k in reversed(range(m.n_blocks)):
        for moment, activations, temporaries, held in phases.block[k]:
            block = m.root_in_block[k] if held is None else min(held, m.root_in_block[k])
            moments.append((f"backward of block {k} ({moment})", dict(
                state(top + FP32 * (sum(m.root_in_block[k + 1:]) + block)), gathered=casts,
                activations=activations, temporaries=temporaries)))
    moments.append(("optimizer step", dict(state(params), temporaries=_step_temporaries([m.root], run))))
    return moments


def step_moments(m: ModelSummary, run: Run,
                 checkpointed: Optional[Sequence[bool]] = None) -> List[Tuple[str, Dict[str, int]]]:
    """The moments of one step where memory can peak, each as bytes by category (params, optimizer, grads,
    gathered, unsharded_grads, activations, temporaries; host with cpu_offload)."""
    checkpointed = m.checkpointed if checkpointed is None else checkpointed
    return (_ddp_moments if m.strategy is Strategy.ddp else _fsdp_moments)(m, run, checkpointed)


def memory(m: ModelSummary, run: Run, checkpointed: Optional[Sequence[bool]] = None) -> Memory:
    """Per-rank memory of the config (activation checkpointing as planned, or as given): each category's
    peak over the step's moments, and the largest total."""
    moments = step_moments(m, run, checkpointed)
    keys = ("params", "optimizer", "grads", "gathered", "unsharded_grads", "activations", "temporaries", "host")
    top = {k: max(parts.get(k, 0) for _, parts in moments) for k in keys}
    peak, peak_at = max((sum(v for k, v in parts.items() if k != "host"), name) for name, parts in moments)
    return Memory(sharded_params=top["params"], sharded_grads=top["grads"], optimizer=top["optimizer"],
                  gathered=top["gathered"], unsharded_grads=top["unsharded_grads"], activations=top["activations"],
                  temporaries=top["temporaries"], peak=peak, peak_at=peak_at, host=top["host"])


def recompute_share(checkpointed: Sequence[bool]) -> float:
    """Extra compute of activation checkpointing: one more forward (1/3 of a step) per checkpointed block."""
    return sum(checkpointed) / len(checkpointed) / 3 if checkpointed else 0.0


def traffic(m: ModelSummary, run: Run) -> Traffic:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    syncs = 1 if run.defer_grad_sync else run.micro_steps
    if m.strategy is Strategy.ddp:
        w = run.world_size
        return Traffic(0, 0, 0, syncs * 2 * (w - 1) * FP32 * m.n_params // w)
    units = [*m.units, m.root]
    received = (n - 1) / n
    forward = run.micro_steps * received * e * sum(u.numel for u in units)
    backward = run.micro_steps * received * e * sum(u.numel for u in units if u.reshard_after_forward)
    reduce = syncs * received * r * sum(u.numel for u in units)
    replicas = run.replicas
    across = syncs * 2 * (replicas - 1) / replicas * r * sum(u.shard_numel(n) for u in units)
    return Traffic(int(forward + backward), int(backward), int(reduce), int(across))


# The command.

def summary_for(cfg: DictConfig) -> ModelSummary:
    hf_config = build_hf_config(cfg.model)
    model, plan = planned_model(cfg, hf_config)
    return summarize(cfg, model, plan, hf_config)


def _gib(value: float) -> str:
    value /= GIB
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def format_plan(m: ModelSummary, run: Run) -> str:
    e, mem = run.compute_dtype, memory(m, run)
    replicated = m.strategy is Strategy.ddp
    size = f"{m.n_params / 1e9:.2f}B" if m.n_params >= 1e9 else f"{m.n_params / 1e6:.2f}M"
    layout = "replicated" if replicated else f"shard group {run.shard_group}, {len(m.units) + 1} FSDP units"
    deferring = run.micro_steps > 1 and run.defer_grad_sync
    lines = [
        f"{m.name}: {size} parameters, {m.n_blocks} blocks; {m.strategy.value} on {run.world_size} rank(s), {layout}",
        f"compute {e}, reduce {run.reduce_dtype}; micro-batch {run.micro_batch} x {run.seq_len} tokens, "
        f"{run.micro_steps} micro-batch(es) per step; {_checkpointing(m.checkpointed)}",
        "",
        "memory per rank (GiB)",
    ]
    rows = [
        ("parameters (fp32)" if replicated else "sharded parameters (fp32)", mem.sharded_params, ""),
        ("gradients (fp32)" if replicated else "sharded gradients (fp32)", mem.sharded_grads,
         "param.grad + DDP buckets" if replicated else ""),
        ("optimizer state (AdamW, 2 x fp32)", mem.optimizer, ""),
        (f"parameters gathered in flight ({e})", mem.gathered,
         "autocast weight copies" if replicated else _gathered_note(m)),
        ("gradients unsharded in flight", mem.unsharded_grads, "" if replicated else
         f"one unit in {e} + its {run.reduce_dtype} reduce-scatter input"
         + (" + all accumulated (defer_grad_sync)" if deferring else "")),
    ]
    for ckpt in _activation_variants(m.checkpointed):
        rows.append((f"activations, {_checkpointing(ckpt)}", memory(m, run, ckpt).activations,
                     f"+{recompute_share(ckpt):.0%} compute" if any(ckpt) else ""))
    rows += [("backward and optimizer temporaries", mem.temporaries, ""),
             ("peak", mem.peak, f"at: {mem.peak_at}")]
    if mem.host:
        rows.append(("host memory (cpu_offload)", mem.host, "sharded state, off the device"))
    lines += [f"  {label:<44}{_gib(value):>9}   {note}".rstrip() for label, value, note in rows]
    comm = traffic(m, run)
    lines += ["", "communication per rank per step (GiB received)",
              f"  {'all-gather':<44}{_gib(comm.all_gather):>9}   {_gib(comm.all_gather_backward)} of it in backward",
              f"  {'reduce-scatter':<44}{_gib(comm.reduce_scatter):>9}",
              f"  {'all-reduce':<44}{_gib(comm.all_reduce):>9}"]
    return "\n".join(lines)


def format_compare(rows: Sequence[Tuple[ModelSummary, Run]]) -> str:
    header = ("strategy", "params+grads+optim", "gathered", "unsharded grads", "activations", "peak",
              "all-gather", "reduce-scatter", "all-reduce")
    table = [header]
    for m, run in rows:
        mem, comm = memory(m, run), traffic(m, run)
        table.append((m.strategy.value if run.replicas == 1 else f"hsdp ({run.replicas}x{run.shard_group})",
                      *map(_gib, (mem.sharded_params + mem.sharded_grads + mem.optimizer, mem.gathered,
                                  mem.unsharded_grads, mem.activations, mem.peak, comm.all_gather,
                                  comm.reduce_scatter, comm.all_reduce))))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join(["per rank, GiB (memory) and GiB received per step (communication)", *lines])


def _checkpointing(checkpointed: Sequence[bool]) -> str:
    count = sum(checkpointed)
    if not count:
        return "no checkpointing"
    if count == len(checkpointed):
        return "every block checkpointed"
    return f"{count} of {len(checkpointed)} blocks checkpointed"


def _activation_variants(checkpointed: Tuple[bool, ...]) -> List[Tuple[bool, ...]]:
    """Without checkpointing, and with it as configured (every block when the config has none)."""
    none = (False,) * len(checkpointed)
    return [none, checkpointed if any(checkpointed) else (True,) * len(checkpointed)]


def _gathered_note(m: ModelSummary) -> str:
    if not m.units:
        return "the whole model (root only)"
    if all(not u.reshard_after_forward for u in m.units):
        return "root + every unit, kept from forward to backward"
    kept = sum(not u.reshard_after_forward for u in m.units)
    return "root + current unit + next" + (f" + {kept} resident" if kept else "")


def _split_world_size(argv: Sequence[str]) -> Tuple[Optional[int], List[str]]:
    """world_size=N is the planner's own argument; everything else is a Hydra override."""
    sizes = [a.partition("=")[2] for a in argv if a.startswith("world_size=")]
    if sizes and not (sizes[-1].isdigit() and int(sizes[-1]) > 0):
        raise ConfigError("world_size", f"{sizes[-1]!r} is not a positive integer", "use world_size=N, N >= 1")
    return (int(sizes[-1]) if sizes else None), [a for a in argv if not a.startswith("world_size=")]


def _compare_rows(overrides: Sequence[str], world_size: int, device_type: str) -> List[Tuple[ModelSummary, Run]]:
    rows = []
    for strategy in Strategy:
        options = [f"sharding={strategy.value}"]
        if strategy is Strategy.hsdp:
            if world_size < 4 or world_size % 2:
                continue  # hsdp needs two replicas of at least two shards each
            options.append("sharding.replicate=2")
        cfg = compose([*overrides, *options])
        rows.append((summary_for(cfg), run_settings(cfg, world_size, device_type)))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .trainer import check_config

    parser = argparse.ArgumentParser(prog="python -m fsdp_research.plan", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides as for train.py, and world_size=N "
                        "(default: as the launch would have)")
    parser.add_argument("--compare", action="store_true", help="also compare every sharding option")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="the device type to plan for (default: the trainer's, trainer.device)")
    args = parser.parse_args(argv)
    try:
        world_size, overrides = _split_world_size(args.overrides)
        cfg = compose(overrides)
        world_size = world_size or planned_world_size(cfg.distributed)
        device = device_for(cfg.trainer.device, 0)
        check_config(cfg, world_size, build_hf_config(cfg.model), device)
        device_type = args.device or device.type
        print(format_plan(summary_for(cfg), run_settings(cfg, world_size, device_type)))
        if args.compare:
            print()
            print(format_compare(_compare_rows(overrides, world_size, device_type)))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
