"""The "when it is slow" table as a tool: checks of the composed config and the applied sharding plan (and,
when given, measured numbers) against the usual causes of FSDP running correctly but slowly, in the order
worth checking. Each finding reads "symptom → cause → what to do".

The trainer runs the same checks at start-up (rank 0 logs them, metrics.jsonl gets {"step": 0, "doctor": [...]},
W&B its summary); `fsdp-research doctor` runs them from the command line, with measured numbers from a short
profiled run when asked (the exposed-communication share and the checkpoint save share).
"""

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

from omegaconf import DictConfig

from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.distributed.step_layout import Layout, layout
from fsdp_research.model.dimensions import ModelDims

log = logging.getLogger("fsdp_research")


@dataclass(frozen=True)
class Finding:
    check: str
    symptom: str
    cause: str
    fix: str

    def __str__(self) -> str:
        return f"{self.symptom} → {self.cause} → {self.fix}"


@dataclass(frozen=True)
class _Case:
    """What the checks look at."""

    cfg: DictConfig
    plan: ShardingPlan
    layout: Layout
    measured: dict[str, float]
    # plan --fit's pick for the device's memory: {overrides, tokens_per_s, this_tokens_per_s, this_peak_gib,
    # cap_gib, usable_gib (the cap less its headroom), device} (fsdp_research.planner.fit.doctor_fit).
    fit: dict | None = None

    def block_units(self):
        return [u for u in self.plan.units if u.path in self.plan.blocks]

    def units_inside_blocks(self):
        return [
            u for u in self.plan.units if not u.by_family and any(u.path.startswith(b + ".") for b in self.plan.blocks)
        ]


# Each check returns the cause it found in this case, or None.


def _root_only(c: _Case) -> str | None:
    if [u.path for u in c.plan.units if not u.by_family] == [""]:
        return (
            f"the root is the only FSDP unit: all {len(c.plan.blocks)} blocks' parameters are gathered at once, "
            "so peak memory holds the whole model and no gather overlaps compute"
        )


def _too_fine(c: _Case) -> str | None:
    inside = c.units_inside_blocks()
    if inside:
        return (
            f"{len(inside)} FSDP units inside the {len(c.plan.blocks)} blocks: each gather and reduce-scatter "
            "moves a few small tensors, so the collectives' fixed latency dominates and too little compute "
            "sits between them to hide it"
        )


def _slow_interconnect(c: _Case) -> str | None:
    n, nodes = c.layout.shard_group, c.layout.nodes
    if nodes > 1 and n > c.layout.world_size // nodes and any(u.reshard_after_forward for u in c.plan.units):
        return (
            f"parameters are fully sharded over {n} ranks on {nodes} nodes: every all-gather "
            "(twice per step) and reduce-scatter crosses the inter-node link"
        )
    share = c.measured.get("exposed_comm_share")
    if share is not None and share > c.cfg.doctor.exposed_comm_share:
        return (
            f"communication that no compute hides takes {share:.0%} of a step "
            f"(doctor.exposed_comm_share {c.cfg.doctor.exposed_comm_share:.0%})"
        )


def _reshard_all(c: _Case) -> str | None:
    blocks = c.block_units()
    if blocks and all(u.reshard_after_forward for u in blocks):
        return (
            f"all {len(blocks)} blocks, the last one too, free their parameters after forward: the last is "
            "gathered again right away, as backward starts with it"
        )


def _checkpoint_save(c: _Case) -> str | None:
    save, step = c.measured.get("checkpoint_save_s"), c.measured.get("step_time_s")
    if save is None or not step:
        return None
    interval = c.cfg.checkpoint.interval or c.cfg.trainer.max_steps
    share = save / (step * interval)
    if share > c.cfg.doctor.checkpoint_share:
        return (
            f"each resume checkpoint stops training for {save:.2f} s, {share:.0%} of the {interval} steps "
            f"between saves (doctor.checkpoint_share {c.cfg.doctor.checkpoint_share:.0%}); these are sharded "
            "DCP saves already: the full state dict is gathered only once, for the export"
        )


def _cpu_offload(c: _Case) -> str | None:
    if c.cfg.sharding.cpu_offload and c.plan.units:
        return (
            "parameters, gradients and optimizer state live in CPU memory: each step copies every parameter "
            "to the device and every gradient back, and the optimizer steps on the CPU"
        )


def _deferred_grads(c: _Case) -> str | None:
    micro, n, reduce = c.layout.micro_steps, c.layout.shard_group, c.cfg.precision.reduce_dtype
    if n > 1 and micro > 1 and c.cfg.trainer.defer_grad_sync and c.plan.units:
        accumulated = ", accumulated in bfloat16" if reduce == "bfloat16" else ""
        return (
            f"trainer.defer_grad_sync=true over {micro} micro-batches: every rank holds every unit's unsharded "
            f"gradient ({reduce}{accumulated}) between them, whatever the world size, instead of 1/{n} of it"
        )


def _not_fit(c: _Case) -> str | None:
    f = c.fit
    if not f:
        return None
    pick = (
        f"plan --fit {f['cap_gib']:g} GiB on {f['device']} picks {f['overrides']} ({f['tokens_per_s']:,.0f} tokens/s)"
    )
    if f["this_peak_gib"] > f["usable_gib"]:
        return (
            f"this config's predicted peak, {f['this_peak_gib']:.1f} GiB, does not fit the "
            f"{f['usable_gib']:.1f} GiB usable (doctor.fit_headroom); {pick}"
        )
    if f["tokens_per_s"] > f["this_tokens_per_s"] * (1 + c.cfg.doctor.fit_margin):
        return f"{pick}, against {f['this_tokens_per_s']:,.0f} predicted for this config"


# (check, symptom, detect, what to do), in the order worth checking.
CHECKS: tuple[tuple[str, str, Callable[[_Case], str | None], str], ...] = (
    ("root_only", "wrapped only the root", _root_only, "wrap each repeating block: sharding=blockwise"),
    ("per_linear", "wrapped too finely", _too_fine, "wrap blocks, not layers: sharding=blockwise"),
    (
        "slow_interconnect",
        "full sharding on a slow interconnect",
        _slow_interconnect,
        "shard within a node and replicate across nodes (sharding=hsdp sharding.replicate=<nodes>), or keep "
        "parameters gathered after forward (sharding=no_reshard), or accumulate gradients (a larger "
        "trainer.global_batch_size over the same micro-batch: fewer reductions per sample)",
    ),
    (
        "reshard_all",
        "reshard_after_forward on everywhere",
        _reshard_all,
        "leave the last block resident: sharding=blockwise",
    ),
    (
        "checkpoint_save",
        "checkpoint saves take a large share of training",
        _checkpoint_save,
        "checkpoint.async=true (write in the background), or a larger checkpoint.interval",
    ),
    (
        "cpu_offload",
        "CPU offload left on",
        _cpu_offload,
        "sharding.cpu_offload=false, unless the model does not fit on the devices without it",
    ),
    (
        "grad_sync",
        "unsharded gradients held through accumulation",
        _deferred_grads,
        "trainer.defer_grad_sync=false (the default: each micro-batch reduce-scatters into the shards); across "
        "nodes, sharding=hsdp all-reduces across replicas once per step either way",
    ),
    (
        "fit",
        "not the config plan --fit picks for this memory",
        _not_fit,
        "add those overrides (fsdp-research plan --fit <GiB> world_size=N shows the ranking; a finding, not an "
        "error: a config kept on purpose may stay)",
    ),
)


def diagnose(
    cfg: DictConfig,
    plan: ShardingPlan,
    world_size: int,
    nodes: int,
    measured: dict[str, float] | None = None,
    fit: dict | None = None,
) -> list[Finding]:
    """The findings for this config and plan on world_size ranks over `nodes` nodes. measured (optional):
    exposed_comm_share, step_time_s, checkpoint_save_s; fit (optional): plan --fit's pick for the device."""
    case = _Case(cfg, plan, layout(cfg, world_size, nodes), measured or {}, fit)
    return [
        Finding(name, symptom, cause, fix)
        for name, symptom, detect, fix in CHECKS
        if (cause := detect(case)) is not None
    ]


def explain(cfg: DictConfig, plan: ShardingPlan, world_size: int, nodes: int, model: ModelDims | None = None) -> str:
    """Why a config with no findings is fine, in one phrase: what the plan does (and, for a mixture of experts,
    that its communication is of all the experts while its compute is of the active ones)."""
    if not plan.units:
        shape = "no FSDP units (plain DDP)"
    else:
        resident = sum(not u.reshard_after_forward for u in plan.units if u.path in plan.blocks)
        shape = (
            f"{len(plan.units)} FSDP units: each of the {len(plan.blocks)} blocks ({resident} resident) and the root"
        )
    moe = ""
    if model and model.experts:
        ep = cfg.parallel.ep
        gathers = f"{model.experts // ep} experts a rank (ep {ep}), the tokens move" if ep > 1 else "every expert"
        moe = (
            f"; a mixture of experts, {model.experts_per_token} of {model.experts} per token: each block's all-gather "
            f"moves {gathers}, its compute uses the active ones"
        )
    return (
        f"{plan.strategy.value} on {world_size} rank(s), {nodes} node(s): {shape}; "
        f"CPU offload {'on' if cfg.sharding.cpu_offload else 'off'}; "
        f"{layout(cfg, world_size, nodes).micro_steps} micro-batch(es) per step{moe}"
    )


def report(findings: list[Finding], sinks, step: int) -> None:
    """Rank 0 at start-up: each finding as a warning, and all of them to metrics.jsonl and W&B."""
    for finding in findings:
        log.warning(f"doctor: {finding}")
    if findings:
        sinks.note(step, "doctor", [asdict(f) for f in findings])
    else:
        log.info("doctor: no findings")
