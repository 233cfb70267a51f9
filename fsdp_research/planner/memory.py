"""The planner's model of memory and communication per rank, without allocating anything (the model behind the
summary is built on the meta device, wrapped for activation checkpointing and planned as the trainer does).

Everything below is a pure function of a ModelSummary (each FSDP unit's parameter shapes, from the plan; the block
shapes, from the HF config) and a Run (world size, dtypes, batch). Bytes per rank; e = compute bytes
(precision.param_dtype), r = reduce bytes, h = hidden, i = intermediate, a = heads, V = vocab, n = the shard group
(data-parallel ranks, / replicate for hsdp). tests/planner/test_plan.py checks it against torch's FSDP memory tracker.

State: parameters fp32 (one tp rank's part; FSDP2 pads each dim 0 to a multiple of n), gradients the same
(FSDP2 keeps sharded gradients in the sharded parameter's dtype), the optimizer's state (AdamW 2 x fp32;
fsdp_research.optim.state_size knows others; Muon's matrices 1 x) (ddp is FSDP2 over a shard group of one rank).
ddp_classic (torch's DDP) replicates all three, holds its gradients twice (param.grad and DDP's flat all-reduce
buckets), and its autocast saves a compute-dtype copy of every weight.

Activations saved per block: fsdp_research.planner.activations.

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
step (its temporaries: fsdp_research.planner.optimizer). Held at every moment: the callbacks' declared state and
reshard_after_forward=k's NCCL communicators (fsdp_research.planner.resident).

Communication: fsdp_research.planner.traffic.
"""

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import FP32
from fsdp_research.planner.axes import AXES
from fsdp_research.planner.generation import generation_moments
from fsdp_research.planner.optimizer import step_temporaries
from fsdp_research.planner.phases import Phases, step_phases
from fsdp_research.planner.resident import callback_bytes, communicator_bytes
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary


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
    # The callbacks' declared state; the NCCL communicators of reshard_after_forward=k's process groups.
    callbacks: int = 0
    communicators: int = 0
    # The KV cache of a micro-batch's generation (objective=grpo).
    kv_cache: int = 0


def _largest_units(m: ModelSummary) -> list[int | None]:
    """Each block's largest unit (its index in m.units), or None for a block with none."""
    largest: list[int | None] = [None] * m.n_blocks
    for j, u in enumerate(m.units):
        k = u.block
        if k is not None and (largest[k] is None or u.numel > m.units[largest[k]].numel):
            largest[k] = j
    return largest


def _fsdp_backward(
    m: ModelSummary,
    run: Run,
    phases: Phases,
    state: Callable[[int], dict[str, int]],
    resident: Callable[[int], int],
    deferred: int,
) -> list[tuple[str, dict[str, int]]]:
    """The moments of backward, block by block: the block's largest unit is the one in flight (per_linear: a
    Linear; root_only: none, the block's gradients are the root's)."""
    e, r, units, root = run.compute_bytes, run.reduce_bytes, list(m.units), run.compute_bytes * m.root.numel
    largest = _largest_units(m)
    root_before = list(itertools.accumulate(m.root_in_block, initial=0))
    moments = []
    for k in reversed(range(m.n_blocks)):
        j = largest[k]
        unit = units[j].numel if j is not None else 0
        # Its gradients: of its trained parameters only (LoRA's frozen base makes none).
        unit_grads = units[j].trained().numel if j is not None else 0
        # The units backward gathers ahead (FSDP2's implicit: the next one), unless kept gathered since forward.
        ahead = units[max(0, (j or 0) - max(1, run.prefetch_backward)) : j or 0]
        prefetch = sum(u.numel for u in ahead if u.reshard_after_forward is not False)
        # FSDP2 keeps the previous unit's reduce-scatter input until this unit's reduction starts.
        previous = units[j + 1].trained().numel if j is not None and j + 1 < len(units) else 0
        # Not resharded after backward (a pipeline's schedule): the units behind stay gathered until the last
        # micro-batch's backward is done.
        done = sum(u.numel for u in units[j + 1 :]) if not run.reshard_after_backward and j is not None else 0
        # The root's gradients stay unsharded until its reduction at the very end of backward; the input
        # embedding's is computed last.
        root_grads = (
            e * (m.root.numel - m.input_embedding - root_before[k]) * m.root.trained().numel // max(m.root.numel, 1)
        )
        for moment, activations, temporaries, held in phases.block[k]:
            reducing = held == 0
            if reducing and j is None:
                continue
            moments.append(
                (
                    f"backward of block {k} ({moment})",
                    dict(
                        state(j + 1 if j is not None else len(units)),
                        gathered=root + resident(j or 0) + e * (unit + prefetch + done),
                        # Autograd holds a unit's gradients until FSDP takes them for its reduce-scatter.
                        unsharded_grads=deferred + ((e + r) * unit_grads if reducing else r * previous),
                        activations=activations,
                        temporaries=temporaries
                        + root_grads
                        + e * (unit_grads if held is None else min(held, unit) * unit_grads // max(unit, 1)),
                    ),
                )
            )
    return moments


def _forward_prefetch(
    m: ModelSummary,
    run: Run,
    phases: Phases,
    state: dict[str, int],
    resident: Callable[[int], int],
    deferred: int,
) -> list[tuple[str, dict[str, int]]]:
    """Forward of each block with explicit prefetch: its unit and the next prefetch_forward gathered at once."""
    e, units = run.compute_bytes, list(m.units)
    moments = []
    for k, j in enumerate(_largest_units(m)):
        if j is None:
            continue
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


def _forward_moments(
    m: ModelSummary, run: Run, phases: Phases, state: dict[str, int], kept: int, deferred: int
) -> list[tuple[str, dict[str, int]]]:
    """From the root's all-gather to the start of backward; `kept`: what stays gathered from forward to backward."""
    e, units = run.compute_bytes, list(m.units)
    root = e * m.root.numel
    # The last all-gather's buffer is kept until the root's forward ends: the last unit's, or the root's own.
    last_gathered = e * (units[-1].numel if units else m.root.numel)
    return [
        # The root's all-gather buffer, until the first unit's all-gather (already issued) replaces it.
        (
            "the root's all-gather",
            dict(state, gathered=2 * root + e * (units[0].numel if units else 0), unsharded_grads=deferred),
        ),
        (
            "end of the root's forward",
            dict(
                state,
                gathered=root + kept + last_gathered,
                unsharded_grads=deferred,
                activations=phases.root_forward_end,
            ),
        ),
        ("end of forward", dict(state, gathered=root + kept, unsharded_grads=deferred, activations=phases.forward_end)),
        (
            "start of backward",
            dict(
                state,
                gathered=root + kept,
                unsharded_grads=deferred,
                activations=phases.backward_start,
                temporaries=phases.loss_grads,
            ),
        ),
    ]


def _fsdp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> list[tuple[str, dict[str, int]]]:
    e, r, n = run.compute_bytes, run.reduce_bytes, run.shard_group
    units, every = list(m.units), [*m.units, m.root]
    phases = step_phases(m, run, checkpointed)
    # Gradients and optimizer state: of the trained parameters (LoRA: the adapters).
    trained = [u.trained() for u in every]
    grad_shards = FP32 * sum(u.shard_numel(n) for u in trained)
    # LoRA's frozen base is stored in the compute dtype.
    shards = grad_shards + e * sum(u.shard_numel(n) - t.shard_numel(n) for u, t in zip(every, trained))
    accumulating = run.micro_steps > 1
    # Earlier micro-batches' gradients: reduced into the shards, or (deferred) kept unsharded in the reduce dtype.
    sharded_before = accumulating and not run.defer_grad_sync
    deferred = r * sum(u.numel for u in trained) if accumulating and run.defer_grad_sync else 0

    # The sharded gradients of units[j:], once backward has reduced them.
    reduced = list(itertools.accumulate((FP32 * u.shard_numel(n) for u in reversed(trained[:-1])), initial=0))[::-1]

    kept = _kept(m, run)

    def state(start: int) -> dict[str, int]:
        grads = grad_shards if sharded_before else reduced[start]
        return dict(kept, params=shards, optimizer=int(m.optimizer_copies * grad_shards), grads=grads)

    # Gathered from forward to backward, by the units before each index: kept whole, or resharded to k ranks.
    held = [0]
    for u in units:
        k = u.kept_after_forward()
        held.append(held[-1] + (0 if not k else e * (u.numel if k == 1 else u.shard_numel(k))))

    def resident(before: int) -> int:
        return held[before]

    moments = _forward_moments(m, run, phases, state(len(units)), resident(len(units)), deferred)
    if run.prefetch_forward:
        moments += _forward_prefetch(m, run, phases, state(len(units)), resident, deferred)
    moments += _fsdp_backward(m, run, phases, state, resident, deferred)
    moments.append(
        (
            "the root's gradient reduction",
            # FSDP2 frees each unsharded gradient once copied into the reduce-scatter input: the largest remains.
            dict(
                state(0),
                gathered=e * m.root.numel,
                unsharded_grads=deferred + r * trained[-1].numel + e * trained[-1].largest,
            ),
        )
    )
    for axis in AXES:
        moments = axis.moments(moments, m, run, deferred, phases)
    moments.append(("optimizer step", dict(state(0), grads=grad_shards, temporaries=step_temporaries(m, trained, run))))
    moments += generation_moments(m, run, dict(state(0), grads=0), resident(len(units)))
    if run.cpu_offload:  # the callbacks' copies of the parameters are made where the parameters live
        for _, parts in moments:
            parts["host"] = sum(parts.pop(k) for k in ("params", "optimizer", "grads", "callbacks"))
    return moments


def _ddp_moments(m: ModelSummary, run: Run, checkpointed: Sequence[bool]) -> list[tuple[str, dict[str, int]]]:
    """Replicated fp32 parameters, gradients (param.grad, and DDP's flat buckets for the whole run) and AdamW
    state. Under autocast each weight's compute-dtype copy is saved for backward: a model's worth, held from
    forward to backward."""
    phases = step_phases(m, run, checkpointed)
    # Gradients and optimizer state: of the trained parameters (LoRA: the adapters), the whole model's share.
    trained = FP32 * m.root.trained().numel
    # LoRA's frozen base is stored in the compute dtype: autocast casts the trained parameters alone.
    frozen = m.n_params - m.root.trained().numel
    params = trained + run.compute_bytes * frozen
    casts = m.root.trained().numel * run.compute_bytes if run.compute_bytes != FP32 else 0
    before = params if run.micro_steps > 1 else 0

    kept = _kept(m, run)

    def state(grads: int) -> dict[str, int]:
        grads = trained + max(before, grads) * trained // max(params, 1)
        return dict(kept, params=params, optimizer=int(m.optimizer_copies * trained), grads=grads)

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
    moments.append(("optimizer step", dict(state(params), temporaries=step_temporaries(m, [m.root.trained()], run))))
    return moments + generation_moments(m, run, dict(state(0), grads=trained))  # DDP's buckets stay


def _kept(m: ModelSummary, run: Run) -> dict[str, int]:
    """Held at every moment: the callbacks' state, the communicators' buffers."""
    return dict(callbacks=callback_bytes(m, run), communicators=communicator_bytes(m, run))


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
    keys = (
        "params",
        "optimizer",
        "grads",
        "gathered",
        "unsharded_grads",
        "activations",
        "temporaries",
        "host",
        "callbacks",
        "communicators",
        "kv_cache",
    )
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
        callbacks=top["callbacks"],
        communicators=top["communicators"],
        kv_cache=top["kv_cache"],
    )
