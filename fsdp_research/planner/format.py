"""The planner's output: one config's memory and traffic per rank, or every sharding side by side."""

from collections.abc import Sequence
from dataclasses import replace

from omegaconf import DictConfig

from fsdp_research.config.schema import Strategy
from fsdp_research.planner.activations import recompute_share
from fsdp_research.planner.axes import AXES
from fsdp_research.planner.budget import Budget
from fsdp_research.planner.fit import Candidate
from fsdp_research.planner.memory import Memory, memory
from fsdp_research.planner.resident import extra_groups
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary
from fsdp_research.planner.timing import Hardware, StepTime, tokens_per_second
from fsdp_research.planner.traffic import traffic

GIB = 2**30


def _experts_note(m: ModelSummary) -> str:
    if not m.experts:
        return ""
    active = f"{_count(m.active_params)} active per token: {m.experts_per_token} of {m.experts} experts"
    if m.ep > 1:
        return f" ({active}; ep {m.ep}: a rank gathers {m.experts // m.ep} experts a layer, the tokens move)"
    return f" ({active}; all-gathers move every expert)"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(value: float) -> str:
    value /= GIB
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


def _trained_note(m: ModelSummary) -> str:
    """LoRA: the parameters with gradients and optimizer state."""
    units = (*m.units, m.root)
    trained = sum(u.trained().numel for u in units)
    return f" ({_count(trained * m.tp)} trained)" if trained != sum(u.numel for u in units) else ""


def _layout(m: ModelSummary, run: Run) -> str:
    """The plan line's layout: replicated (ddp_classic, which refuses tp and cp), or the shard group, its units, tp
    and cp."""
    if m.strategy is Strategy.ddp_classic:
        return "replicated"
    axes = "".join(axis.describe(m, run) for axis in AXES)
    return f"shard group {run.shard_group}, {len(m.units) + 1} FSDP units{axes}"


def format_stages(parallel, run: Run, peaks: list[int], largest: int) -> str:
    """Pipeline parallel's line: the schedule, each pipeline rank's peak, the one planned below, the bubble."""
    each = ", ".join(f"{p / GIB:.2f}" for p in peaks)
    looped = f", {parallel.pp_stages_per_rank} stages a rank" if parallel.pp_stages_per_rank > 1 else ""
    return (
        f"pipeline: pp {parallel.pp} by {parallel.pp_schedule}{looped}, {run.micro_steps} micro-batches; peak by "
        f"pipeline rank {each} GiB (rank {largest}'s planned below); bubble {run.bubble:.0%} of the step"
    )


def _parts(run: Run) -> str:
    """A generated sequence's prompt and completion."""
    g = run.generation
    return f" ({run.seq_len - g.tokens} prompt + {g.tokens} completion)" if g else ""


def format_plan(m: ModelSummary, run: Run) -> str:
    e, mem = run.compute_dtype, memory(m, run)
    replicated = m.strategy is Strategy.ddp_classic
    stage = " (a pipeline rank's stages)" if run.pp > 1 else ""
    size = f"{_count(m.n_params)} parameters{stage}" + _experts_note(m) + _trained_note(m)
    deferring = run.micro_steps > 1 and run.defer_grad_sync
    lines = [
        f"{m.name}: {size}, {m.n_blocks} blocks; {m.strategy.value} on {run.world_size} rank(s), {_layout(m, run)}",
        f"compute {e}, reduce {run.reduce_dtype}; micro-batch {run.micro_batch} x {run.seq_len} tokens{_parts(run)}, "
        f"{run.micro_steps} micro-batch(es) per step; {_checkpointing(m.checkpointed)}",
        *([m.optimizer_split] if m.optimizer_split else []),
        "",
        "memory per rank (GiB)",
    ]
    rows = [
        ("parameters (fp32)" if replicated else "sharded parameters (fp32)", mem.sharded_params, ""),
        (
            "gradients (fp32)" if replicated else "sharded gradients (fp32)",
            mem.sharded_grads,
            "param.grad + DDP buckets" if replicated else "",
        ),
        (
            f"optimizer state ({m.optimizer}, {m.optimizer_copies:.3g} x fp32)",
            mem.optimizer,
            "" if m.optimizer_known else "assumed: an optimizer the planner does not know",
        ),
        (
            f"parameters gathered in flight ({e})",
            mem.gathered,
            "autocast weight copies" if replicated else _gathered_note(m, run),
        ),
        (
            "gradients unsharded in flight",
            mem.unsharded_grads,
            ""
            if replicated
            else f"one unit in {e} + its {run.reduce_dtype} reduce-scatter input"
            + (f" + all accumulated ({'the schedule' if run.pp > 1 else 'defer_grad_sync'})" if deferring else ""),
        ),
    ]
    for ckpt in _activation_variants(m.checkpointed):
        rows.append(
            (
                f"activations, {_checkpointing(ckpt)}",
                memory(m, run, ckpt).activations,
                f"+{recompute_share(ckpt):.0%} compute" if any(ckpt) else "",
            )
        )
    rows.append(("backward and optimizer temporaries", mem.temporaries, ""))
    rows += _other_rows(m, run, mem)
    rows.append(("peak", mem.peak, f"at: {mem.peak_at}"))
    if mem.host:
        rows.append(("host memory (cpu_offload)", mem.host, "sharded state, off the device"))
    lines += [f"  {label:<44}{_gib(value):>9}   {note}".rstrip() for label, value, note in rows]
    return "\n".join(lines + _traffic_lines(m, run) + _accumulation(m, run))


def _other_rows(m: ModelSummary, run: Run, mem: Memory) -> list[tuple[str, int, str]]:
    """The rows of what only some runs hold: a generation's KV cache, callbacks' state, NCCL communicators."""
    rows = []
    if mem.kv_cache:
        each = f"{run.micro_batch} x {run.seq_len} positions"
        rows.append(("KV cache (generation)", mem.kv_cache, f"{each}; the sampling's over the vocabulary above"))
    if mem.callbacks:
        names = ", ".join(name for name, _ in run.callbacks)
        rows.append((f"callbacks' state ({names})", mem.callbacks, "as each declares it (planned_bytes)"))
    if mem.communicators:
        groups = extra_groups(m, run)
        rows.append(("NCCL communicators (reshard to k)", mem.communicators, f"{groups} more process groups"))
    return rows


def _traffic_lines(m: ModelSummary, run: Run) -> list[str]:
    comm = traffic(m, run)
    lines = [
        "",
        "communication per rank per step (GiB received)",
        f"  {'all-gather':<44}{_gib(comm.all_gather):>9}   {_gib(comm.all_gather_backward)} of it in backward",
        f"  {'reduce-scatter':<44}{_gib(comm.reduce_scatter):>9}",
        f"  {'all-reduce':<44}{_gib(comm.all_reduce):>9}",
    ]
    if comm.all_to_all:
        lines.append(f"  {'all-to-all (whole matrices for ' + m.optimizer + ')':<44}{_gib(comm.all_to_all):>9}")
    for axis, received in zip(AXES, comm.axes):
        if received:
            lines.append(f"  {axis.row:<44}{_gib(received):>9}")
    return lines


def _accumulation(m: ModelSummary, run: Run) -> list[str]:
    """Both ways of accumulating gradients over a shard group, side by side (a pipeline's schedule has one)."""
    if run.micro_steps == 1 or run.shard_group == 1 or m.strategy is Strategy.ddp_classic or run.pp > 1:
        return []
    lines = ["", f"{f'gradient accumulation over {run.micro_steps} micro-batches':<64}peak  reduce-scatter (GiB)"]
    for defer, label in ((False, "reduce-scatter each micro-batch"), (True, "unsharded gradients held to the last")):
        other = replace(run, defer_grad_sync=defer)
        this = "   this run" if defer == run.defer_grad_sync else ""
        lines.append(
            f"  {f'defer_grad_sync={str(defer).lower()} ({label})':<58}{_gib(memory(m, other).peak):>8}"
            f"{_gib(traffic(m, other).reduce_scatter):>16}{this}"
        )
    return lines


def format_compare(rows: Sequence[tuple[ModelSummary, Run]]) -> str:
    header = (
        "strategy",
        "params+grads+optim",
        "gathered",
        "unsharded grads",
        "activations",
        "peak",
        "all-gather",
        "reduce-scatter",
        "all-reduce",
    )
    table = [header]
    for m, run in rows:
        mem, comm = memory(m, run), traffic(m, run)
        table.append(
            (
                f"hsdp ({run.replicas}x{run.shard_group})" if m.strategy is Strategy.hsdp else m.strategy.value,
                *map(
                    _gib,
                    (
                        mem.sharded_params + mem.sharded_grads + mem.optimizer,
                        mem.gathered,
                        mem.unsharded_grads,
                        mem.activations,
                        mem.peak,
                        comm.all_gather,
                        comm.reduce_scatter,
                        comm.all_reduce,
                    ),
                ),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    return "\n".join(["per rank, GiB (memory) and GiB received per step (communication)", *lines])


def _checkpointing(checkpointed: Sequence[bool]) -> str:
    count = sum(checkpointed)
    if not count:
        return "no checkpointing"
    if count == len(checkpointed):
        return "every block checkpointed"
    return f"{count} of {len(checkpointed)} blocks checkpointed"


def _activation_variants(checkpointed: tuple[bool, ...]) -> list[tuple[bool, ...]]:
    """Without checkpointing, and with it as configured (every block when the config has none)."""
    none = (False,) * len(checkpointed)
    return [none, checkpointed if any(checkpointed) else (True,) * len(checkpointed)]


def _gathered_note(m: ModelSummary, run: Run) -> str:
    if run.generation and run.generation.gathered and m.units:
        return "the whole model while generating (objective.gather_for_generation)"
    if not m.units:
        return "the whole model (root only)"
    if all(not u.reshard_after_forward for u in m.units):
        return "root + every unit, kept from forward to backward"
    kept = sum(not u.reshard_after_forward for u in m.units)
    return "root + current unit + next" + (f" + {kept} resident" if kept else "")


def format_time(time: StepTime, run: Run, hw: Hardware) -> str:
    tokens_per_s = tokens_per_second(run, time)
    return "\n".join(
        [
            "",
            f"step time on {hw.name} (predicted)",
            f"  {'compute':<44}{time.compute:>9.3f} s",
            f"  {'recompute (checkpointing, loss chunks)':<44}{time.recompute:>9.3f} s",
            f"  {'communication, not hidden':<44}{time.exposed:>9.3f} s   of {time.communication:.3f} s",
            f"  {'optimizer step':<44}{time.optimizer:>9.3f} s",
            *(
                [f"  {'whole matrices (all-to-alls, Newton-Schulz)':<44}{time.whole_matrices:>9.3f} s"]
                if time.whole_matrices
                else []
            ),
            *([f"  {'cpu_offload copies':<44}{time.offload:>9.3f} s"] if time.offload else []),
            *([f"  {'pipeline bubble (waiting on other stages)':<44}{time.bubble:>9.3f} s"] if time.bubble else []),
            f"  {'step':<44}{time.total:>9.3f} s   {tokens_per_s:,.0f} tokens/s over {run.world_size} rank(s)",
            *([f"  {'start-up: NCCL communicators (once)':<44}{time.startup:>9.3f} s"] if time.startup else []),
        ]
    )


def format_fit(
    fitting: Sequence[Candidate], found: Sequence[Candidate], room: Budget, top: int, base: DictConfig, head: str
) -> list[str]:
    """The top configs that fit, fastest first, as rows: rank, tokens/s, step time, peak, the host memory a rank's
    cpu_offload takes (where one does), the overrides."""
    fit = sum(c.memory.peak <= room.usable for c in found)
    shown = fitting[:top]
    host = any(c.memory.host for c in shown)
    lines = [
        f"plan --fit {room} per rank: {head}; {len(found)} configs planned, {fit} fit, "
        f"{len(fitting)} of them none beats in both speed and peak",
        f"{'rank':>4}  {'tokens/s':>10}  {'step (s)':>8}  {'peak (GiB)':>10}  "
        + (f"{'host (GiB)':>10}  " if host else "")
        + "config",
    ]
    for index, c in enumerate(shown, 1):
        lines.append(
            f"{index:>4}  {c.tokens_per_s:>10,.0f}  {c.time.total:>8.3f}  {c.memory.peak / GIB:>10.2f}  "
            + (f"{c.memory.host / GIB:>10.2f}  " if host else "")
            + " ".join(c.overrides(base))
        )
    return lines
