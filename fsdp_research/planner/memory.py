"""The planner's model of memory and communication per rank, without allocating anything (the model behind the
summary is built on the meta device, wrapped for activation checkpointing and planned as the trainer does).

Everything below is a pure function of a ModelSummary (each FSDP unit's parameter shapes, from the plan; the block
shapes, from the HF config) and a Run (world size, dtypes, batch). Bytes per rank; e = compute bytes
(precision.param_dtype), r = reduce bytes, h = hidden, i = intermediate, a = heads, V = vocab, n = the shard
group (world_size, or world_size / replicate for hsdp). tests/test_plan.py checks it against torch's FSDP memory
tracker.

State: parameters fp32 (FSDP2 pads each dim 0 to a multiple of n), gradients the same (FSDP2 keeps sharded
gradients in the sharded parameter's dtype), the optimizer's state (AdamW 2 x fp32; fsdp_research.optim.state
knows others; Muon's matrices 1 x) (ddp is FSDP2 over a shard group of one rank).
ddp_classic (torch's DDP) replicates all three, holds its gradients twice (param.grad and DDP's flat all-reduce
buckets), and its autocast saves a compute-dtype copy of every weight.

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
micro-batch). hsdp and ddp add an all-reduce of the gradient shards across replicas, once per step (accumulated
into the shards before it); ddp_classic all-reduces fp32 gradients. Muon (optim=muon) adds two all-to-alls of the
blocks' matrices in fp32 per step, within the shard group.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import Strategy
from .summary import ModelSummary, Run, UnitSize

FP32 = 4
# Same block as HF's Llama: RMSNorm, rotary SDPA attention, SwiGLU MLP.
LLAMA_LIKE = ("llama", "mistral", "qwen2")


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
    # Whole-matrix optimizers (Muon): each rank's shards of every block matrix to its owner and back (fp32).
    all_to_all: int = 0
    # The part of all_gather_backward within the smaller groups of reshard_after_forward=k (a node's links).
    regather_within: int = 0


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


def _matmul_widths(m: ModelSummary) -> list[int]:
    """The output widths of a llama block's matmuls in forward order: q, k, v, o, gate, up, down."""
    return [m.hidden, m.kv_dim, m.kv_dim, m.hidden, m.intermediate, m.intermediate, m.hidden]


def selective_bytes(m: ModelSummary, e: int, seq_len: int) -> int:
    """What a selectively checkpointed block saves per token: its input, the kept matmul outputs, attention's
    output and logsumexp (when an SDPA kernel is kept). Other families: half of a block's full activations."""
    if m.model_type not in LLAMA_LIKE:
        return e * m.hidden + block_activation_bytes(m, e, seq_len) // 2
    kept = sum(w for index, w in enumerate(_matmul_widths(m)) if index % m.selective_every == 0)
    attention = e * m.hidden + FP32 * m.heads if m.selective_attention else 0
    return e * (m.hidden + kept) + attention


def saved_activations(m: ModelSummary, e: int, seq_len: int, checkpointed: Sequence[bool]) -> list[int]:
    """Per token, what each block holds between its forward and its backward."""
    full = block_activation_bytes(m, e, seq_len)
    kept = selective_bytes(m, e, seq_len) if m.selective_every else e * m.hidden
    return [kept if ckpt else full for ckpt in checkpointed]


def selective_recompute(m: ModelSummary) -> float:
    """The share of a selectively checkpointed llama block's forward FLOPs recomputed: the matmuls not kept
    (the rest it recomputes, norms and activations, costs no matmul); attention's too when it is not kept."""
    widths = _matmul_widths(m)
    inputs = [m.hidden] * 4 + [m.hidden] * 2 + [m.intermediate]
    flops = [w * i for w, i in zip(widths, inputs)]
    redone = sum(f for index, f in enumerate(flops) if index % m.selective_every)
    return redone / sum(flops)


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
    block: list[list[tuple[str, int, int, int | None]]]


def _phases(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> _Phases:
    e, tok, h = run.compute_bytes, run.tokens, m.hidden
    saved = [a * tok for a in saved_activations(m, e, run.seq_len, checkpointed)]
    full_block = block_activation_bytes(m, e, run.seq_len) * tok
    norm = _norm_bytes(m, e) * tok
    incoming = e * h * tok  # the gradient flowing down the residual stream

    def inside(k: int) -> list[tuple[str, int, int, int | None]]:
        # A block's own activations are all there as its backward starts (recomputed when checkpointed). The MLP
        # goes first: its peak holds the gradients of gate, up and their product, once the down projection's
        # backward has released its input. Then the norms and attention.
        mlp_peak = full_block - _mlp_saved_bytes(m, e) * tok // 4  # the product: one of the MLP's four
        return [
            ("MLP", sum(saved[:k]) + mlp_peak, incoming + 3 * e * m.intermediate * tok, h * m.intermediate),
            (
                "attention",
                sum(saved[:k]) + full_block - _mlp_saved_bytes(m, e) * tok,
                incoming + max(_norm_backward_bytes(m, e), e * (2 * h + 2 * m.kv_dim)) * tok,
                None,
            ),
            ("reduction", sum(saved[:k]), incoming, 0),
        ]

    # loss.chunks: one slice's logits at a time, made again in backward, where its gradients join them; the
    # model's forward itself returns the hidden states.
    c = run.loss_chunks
    chunked = c > 1
    return _Phases(
        forward_end=sum(saved) + norm + _logits_forward(m, e) * tok // c,
        root_forward_end=sum(saved) + norm + (0 if chunked else e * m.vocab * tok),
        backward_start=sum(saved) + norm + (0 if chunked else FP32 * m.vocab * tok),
        loss_grads=(_logits_forward(m, e) + 2 * FP32 * m.vocab) * tok // c if chunked else 2 * FP32 * m.vocab * tok,
        block=[inside(k) for k in range(m.n_blocks)],
    )


def _step_temporaries(units: Sequence[UnitSize], run: Run) -> int:
    if run.foreach:
        return FP32 * sum(u.shard_numel(run.shard_group) for u in units)
    return 2 * FP32 * max(-(-rows // run.shard_group) * row for u in units for rows, row in u.shapes)


def _fsdp_backward(
    m: ModelSummary,
    run: Run,
    phases: _Phases,
    state: Callable[[Sequence[UnitSize]], dict[str, int]],
    resident: Callable[[int], int],
    deferred: int,
) -> list[tuple[str, dict[str, int]]]:
    """The moments of backward, block by block: the block's largest unit is the one in flight (per_linear: a
    Linear; root_only: none, the block's gradients are the root's)."""
    e, r, units, root = run.compute_bytes, run.reduce_bytes, list(m.units), run.compute_bytes * m.root.numel
    moments = []
    for k in reversed(range(m.n_blocks)):
        inside = [j for j, u in enumerate(units) if u.block == k]
        j = max(inside, key=lambda i: units[i].numel) if inside else None
        unit = units[j].numel if j is not None else 0
        # The units backward gathers ahead (FSDP2's implicit: the next one), unless kept gathered since forward.
        ahead = units[max(0, (j or 0) - max(1, run.prefetch_backward)) : j or 0]
        prefetch = sum(u.numel for u in ahead if u.reshard_after_forward is not False)
        # FSDP2 keeps the previous unit's reduce-scatter input until this unit's reduction starts.
        previous = units[j + 1].numel if j is not None and j + 1 < len(units) else 0
        # The root's gradients stay unsharded until its reduction at the very end of backward; the input
        # embedding's is computed last.
        root_grads = e * (m.root.numel - m.input_embedding - sum(m.root_in_block[:k]))
        for moment, activations, temporaries, held in phases.block[k]:
            reducing = held == 0
            if reducing and j is None:
                continue
            moments.append(
                (
                    f"backward of block {k} ({moment})",
                    dict(
                        state(units[j + 1 :] if j is not None else []),
                        gathered=root + resident(j or 0) + e * (unit + prefetch),
                        # Autograd holds a unit's gradients until FSDP takes them for its reduce-scatter.
                        unsharded_grads=deferred + ((e + r) * unit if reducing else r * previous),
                        activations=activations,
                        temporaries=temporaries + root_grads + e * (unit if held is None else min(held, unit)),
                    ),
                )
            )
    return moments


def _forward_prefetch(
    m: ModelSummary,
    run: Run,
    phases: _Phases,
    state: dict[str, int],
    resident: Callable[[int], int],
    deferred: int,
) -> list[tuple[str, dict[str, int]]]:
    """Forward of each block with explicit prefetch: its unit and the next prefetch_forward gathered at once."""
    e, units = run.compute_bytes, list(m.units)
    moments = []
    for k in range(m.n_blocks):
        inside = [j for j, u in enumerate(units) if u.block == k]
        if not inside:
            continue
        j = max(inside, key=lambda i: units[i].numel)
        ahead = sum(u.numel for u in units[j : j + 1 + run.prefetch_forward])
        moments.append(
            (
                f"forward of block {k}",
                dict(
                    state,
                    gathered=e * m.root.numel + resident(j) + e * ahead,
                    unsharded_grads=deferred,
                    activations=phases.block[k][-1][1],
                ),
            )
        )
    return moments


def _fsdp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> list[tuple[str, dict[str, int]]]:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    units, every = list(m.units), [*m.units, m.root]
    phases = _phases(m, run, checkpointed)
    shards = FP32 * sum(u.shard_numel(n) for u in every)
    accumulating = run.micro_steps > 1
    # Earlier micro-batches' gradients: reduced into the shards, or (deferred) kept unsharded in the reduce dtype.
    sharded_before = accumulating and not run.defer_grad_sync
    deferred = r * sum(u.numel for u in every) if accumulating and run.defer_grad_sync else 0

    def state(done: Sequence[UnitSize]) -> dict[str, int]:
        grads = shards if sharded_before else FP32 * sum(u.shard_numel(n) for u in done)
        return dict(params=shards, optimizer=int(m.optimizer_copies * shards), grads=grads)

    # Gathered from forward to backward, by the units before each index: kept whole, or resharded to k ranks.
    held = [0]
    for u in units:
        k = u.kept_after_forward()
        held.append(held[-1] + (0 if not k else e * (u.numel if k == 1 else u.shard_numel(k))))

    def resident(before: int) -> int:
        return held[before]

    root, kept = e * m.root.numel, resident(len(units))
    # The last all-gather's buffer is kept until the root's forward ends: the last unit's, or the root's own.
    last_gathered = e * (units[-1].numel if units else m.root.numel)
    moments = [
        # The root's all-gather buffer, until the first unit's all-gather (already issued) replaces it.
        (
            "the root's all-gather",
            dict(state([]), gathered=2 * root + e * (units[0].numel if units else 0), unsharded_grads=deferred),
        ),
        (
            "end of the root's forward",
            dict(
                state([]),
                gathered=root + kept + last_gathered,
                unsharded_grads=deferred,
                activations=phases.root_forward_end,
            ),
        ),
        (
            "end of forward",
            dict(state([]), gathered=root + kept, unsharded_grads=deferred, activations=phases.forward_end),
        ),
        (
            "start of backward",
            dict(
                state([]),
                gathered=root + kept,
                unsharded_grads=deferred,
                activations=phases.backward_start,
                temporaries=phases.loss_grads,
            ),
        ),
    ]
    if run.prefetch_forward:
        moments += _forward_prefetch(m, run, phases, state([]), resident, deferred)
    moments += _fsdp_backward(m, run, phases, state, resident, deferred)
    moments.append(
        (
            "the root's gradient reduction",
            # FSDP2 frees each unsharded gradient once copied into the reduce-scatter input: the largest remains.
            dict(state(units), gathered=root, unsharded_grads=deferred + r * m.root.numel + e * m.root.largest),
        )
    )
    moments.append(("optimizer step", dict(state(every), temporaries=_step_temporaries(every, run))))
    if run.cpu_offload:
        for _, parts in moments:
            parts["host"] = parts.pop("params") + parts.pop("optimizer") + parts.pop("grads")
    return moments


def _ddp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> list[tuple[str, dict[str, int]]]:
    """Replicated fp32 parameters, gradients (param.grad, and DDP's flat buckets for the whole run) and AdamW
    state. Under autocast each weight's compute-dtype copy is saved for backward: a model's worth, held from
    forward to backward."""
    phases = _phases(m, run, checkpointed)
    params = FP32 * m.n_params
    casts = m.n_params * run.compute_bytes if run.compute_bytes != FP32 else 0
    before = params if run.micro_steps > 1 else 0

    def state(grads: int) -> dict[str, int]:
        return dict(params=params, optimizer=int(m.optimizer_copies * params), grads=params + max(before, grads))

    top = FP32 * (m.root.numel - sum(m.root_in_block))
    moments = [
        ("end of forward", dict(state(0), gathered=casts, activations=phases.forward_end)),
        (
            "start of backward",
            dict(state(0), gathered=casts, activations=phases.backward_start, temporaries=phases.loss_grads),
        ),
    ]
    for k in reversed(range(m.n_blocks)):
        for moment, activations, temporaries, held in phases.block[k]:
            block = m.root_in_block[k] if held is None else min(held, m.root_in_block[k])
            moments.append(
                (
                    f"backward of block {k} ({moment})",
                    dict(
                        state(top + FP32 * (sum(m.root_in_block[k + 1 :]) + block)),
                        gathered=casts,
                        activations=activations,
                        temporaries=temporaries,
                    ),
                )
            )
    moments.append(("optimizer step", dict(state(params), temporaries=_step_temporaries([m.root], run))))
    return moments


def step_moments(
    m: ModelSummary, run: Run, checkpointed: Sequence[bool] | None = None
) -> list[tuple[str, dict[str, int]]]:
    """The moments of one step where memory can peak, each as bytes by category (params, optimizer, grads,
    gathered, unsharded_grads, activations, temporaries; host with cpu_offload)."""
    checkpointed = m.checkpointed if checkpointed is None else checkpointed
    return (_ddp_moments if m.strategy is Strategy.ddp_classic else _fsdp_moments)(m, run, checkpointed)


def memory(m: ModelSummary, run: Run, checkpointed: Sequence[bool] | None = None) -> Memory:
    """Per-rank memory of the config (activation checkpointing as planned, or as given): each category's
    peak over the step's moments, and the largest total."""
    moments = step_moments(m, run, checkpointed)
    keys = ("params", "optimizer", "grads", "gathered", "unsharded_grads", "activations", "temporaries", "host")
    top = {k: max(parts.get(k, 0) for _, parts in moments) for k in keys}
    peak, peak_at = max((sum(v for k, v in parts.items() if k != "host"), name) for name, parts in moments)
    return Memory(
        sharded_params=top["params"],
        sharded_grads=top["grads"],
        optimizer=top["optimizer"],
        gathered=top["gathered"],
        unsharded_grads=top["unsharded_grads"],
        activations=top["activations"],
        temporaries=top["temporaries"],
        peak=peak,
        peak_at=peak_at,
        host=top["host"],
    )


def recompute_share(checkpointed: Sequence[bool], redone: float = 1.0) -> float:
    """Extra compute of activation checkpointing: one more forward (1/3 of a step) per checkpointed block, of
    which `redone` (selective checkpointing recomputes a part: selective_recompute)."""
    return sum(checkpointed) / len(checkpointed) / 3 * redone if checkpointed else 0.0


def traffic(m: ModelSummary, run: Run) -> Traffic:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    if m.strategy is Strategy.ddp_classic:  # one all-reduce per step, after the last micro-batch
        w = run.world_size
        return Traffic(0, 0, 0, 2 * (w - 1) * FP32 * m.n_params // w)
    syncs = 1 if run.defer_grad_sync else run.micro_steps
    units = [*m.units, m.root]
    received = (n - 1) / n
    forward = run.micro_steps * received * e * sum(u.numel for u in units)
    # Backward regathers what forward resharded: over the shard group, or (reshard to k) within the group of k.
    kept = [(u, u.kept_after_forward()) for u in units]
    regather = run.micro_steps * e * sum(u.numel * (k - 1) / k for u, k in kept if k and k > 1)
    backward = run.micro_steps * received * e * sum(u.numel for u, k in kept if k is None) + regather
    reduce = syncs * received * r * sum(u.numel for u in units)
    replicas = run.replicas
    # Across replicas the gradient shards accumulate and are all-reduced once per step.
    across = 2 * (replicas - 1) / replicas * r * sum(u.shard_numel(n) for u in units)
    # Muon: a rank receives the other ranks' slices of the 1/n of the matrices it owns, then its slices of the rest.
    whole = 2 * received * FP32 * m.whole_matrices / n
    return Traffic(int(forward + backward), int(backward), int(reduce), int(across), int(whole), int(regather))
