"""plan --fit: every combination of the knobs that decide memory and speed (pipeline stages, tensor parallel within a
node, expert and context parallel, sharding and hsdp replicas, reshard to k ranks, activation checkpointing,
micro-batch, prefetch depth, cpu_offload, loss chunks) planned from one model build (a pipeline: one for each of its
ranks' stages), those whose predicted peak fits the cap (less its headroom: planner.budget) ranked by predicted
tokens/s."""

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fsdp_research.config.schema import typed
from fsdp_research.distributed.pipeline import SCHEDULES
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.hardware import gpu, gpu_named
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.planner.budget import Budget, budget
from fsdp_research.planner.calibrate import cpu_optimizer_rate
from fsdp_research.planner.memory import Memory, memory
from fsdp_research.planner.run import Run, run_settings
from fsdp_research.planner.search_space import (
    CHECKPOINTING,
    chunkable,
    cp_sizes,
    ep_sizes,
    pp_sizes,
    shardings,
    tp_sizes,
    variants,
)
from fsdp_research.planner.summary import ModelSummary, summaries_by_sharding, summarize, summary_for
from fsdp_research.planner.timing import Hardware, StepTime, gpu_hardware, step_time, tokens_per_second

GIB = 2**30
log = logging.getLogger("fsdp_research")
# The groups and keys a candidate sets: a base's own overrides of them, and of their keys, give way.
SEARCHED = ("parallel", "sharding", "activation_checkpointing", "trainer.micro_batch_size", "loss.chunks")


def unsearched(overrides: list[str]) -> list[str]:
    """The overrides of what --fit does not search (the model, the batch, the data, ...)."""

    def searched(override: str) -> bool:
        key = override.lstrip("+~").partition("=")[0]
        return any(key == s or key.startswith(s + ".") for s in SEARCHED)

    return [o for o in overrides if not searched(o)]


@dataclass(frozen=True)
class Candidate:
    # Each knob's value by its config key (the groups by option name: sharding=, activation_checkpointing=).
    settings: dict[str, Any]
    memory: Memory
    time: StepTime
    tokens_per_s: float

    @property
    def extras(self) -> int:
        """Knobs turned away from their defaults: among equals, the plainer config first."""
        s = self.settings
        return (
            bool(s["sharding.prefetch_forward"])
            + s["sharding.cpu_offload"]
            + (s["loss.chunks"] > 1)
            + (s["sharding.reshard_after_forward"] is not None)
            + (s["parallel.pp"] > 1)
        )

    def keys(self) -> dict[str, Any]:
        """The config keys that make it, spelled out (the groups' options as the keys they set)."""
        s = self.settings
        stride, selective = CHECKPOINTING[s["activation_checkpointing"]]
        keys = {
            "sharding.strategy": s["sharding"],
            "sharding.replicate": s["sharding.replicate"] or 1,
            "sharding.reshard_after_forward": s["sharding.reshard_after_forward"],
            "sharding.reshard_override": {},
            "activation_checkpointing.stride": stride,
            "activation_checkpointing.mode": "selective" if selective else "full",
        }
        if selective:
            keys["activation_checkpointing.mm_save_every"] = selective
        return {**keys, **{k: v for k, v in s.items() if "." in k and k not in keys and k != "sharding.replicate"}}

    def changes(self, cfg: DictConfig) -> list[str]:
        """The explicit keys where a config differs from it: what to add after its overrides, in any order."""
        return [
            f"{key}={_text(value)}"
            for key, value in self.keys().items()
            if (OmegaConf.to_container(found) if isinstance(found := OmegaConf.select(cfg, key), DictConfig) else found)
            != value
        ]

    def overrides(self, base: DictConfig) -> list[str]:
        """What makes it after the base config's overrides: the sharding and checkpointing options and the
        micro-batch always, the other knobs where they differ from the base's."""
        always = ("sharding", "sharding.replicate", "activation_checkpointing", "trainer.micro_batch_size")
        return [
            f"{key}={_text(value)}"
            for key, value in self.settings.items()
            if key in always and value is not None or key not in always and OmegaConf.select(base, key) != value
        ]


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def candidates(
    cfg: DictConfig,
    world_size: int,
    device_type: str,
    hw: Hardware,
    planned: tuple[nn.Module, ShardingPlan] | None = None,
    stages: bool = True,
) -> list[Candidate]:
    """Every combination planned, fitting or not, fastest first (ties: the smaller peak); from `planned` (cfg's
    model as planned, before sharding) where given, else from a model built here; with pipeline stages (`stages`:
    a build of each pipeline rank's) or without."""
    plain = {"stride": 0, "mode": "full"}
    base = typed(
        OmegaConf.merge(
            cfg, {"activation_checkpointing": plain, "sharding": {"prefetch_forward": 0, "prefetch_backward": 0}}
        )
    )
    base.sharding.reshard_override = {}
    hf_config = build_hf_config(base.model)
    found = []
    for pp in pp_sizes(base, hf_config, world_size) if stages else [1]:
        found += _of_pipeline(base, hf_config, pp, world_size, device_type, hw, planned if pp == 1 else None)
    return sorted(found, key=lambda c: (-c.tokens_per_s, c.memory.peak, c.extras))


def _pipeline_keys(base: DictConfig, pp: int) -> dict[str, Any]:
    """The parallel section's pipeline keys of `pp` ranks: one stage a rank (the base's schedule where it is such,
    else 1F1B), split evenly."""
    keys: dict[str, Any] = {"pp": pp, "pp_split_points": []}
    if pp > 1:
        one = SCHEDULES[base.parallel.pp_schedule] == 1
        keys |= {"pp_schedule": base.parallel.pp_schedule if one else "1F1B", "pp_stages_per_rank": 1}
    return keys


def _layouts(base: DictConfig, hf_config, pp: int, ranks: int, per_node: int) -> list[tuple[int, int, int, dict]]:
    """(tp, ep, cp, sharding keys) of every layout searched over a stage's `ranks` (ep and cp without stages)."""
    return [
        (tp, ep, cp, keys)
        for tp in tp_sizes(base, hf_config, ranks, per_node)
        for keys in shardings(ranks // tp, per_node // tp, pp)
        for ep in (ep_sizes(base, hf_config, ranks, tp, keys) if pp == 1 else [1])
        for cp in (cp_sizes(base, hf_config, ranks, tp, keys, per_node) if pp == 1 else [1])
    ]


def _candidate(settings: dict[str, Any], ranks: list[tuple[ModelSummary, Run]], hw: Hardware) -> Candidate:
    """A config of each pipeline rank's summary and run (one without stages): its largest rank's peak, the slowest
    rank's step."""
    mems = [memory(m, run) for m, run in ranks]
    times = [step_time(m, run, hw) for m, run in ranks]
    largest = max(range(len(ranks)), key=lambda k: mems[k].peak)
    slowest = max(range(len(ranks)), key=lambda k: times[k].total)
    return Candidate(settings, mems[largest], times[slowest], tokens_per_second(ranks[slowest][1], times[slowest]))


def _of_pipeline(
    base: DictConfig,
    hf_config,
    pp: int,
    world_size: int,
    device_type: str,
    hw: Hardware,
    planned: tuple[nn.Module, ShardingPlan] | None,
) -> list[Candidate]:
    """The candidates of `pp` pipeline ranks (none where the model's layers do not split so): every sharding's
    summary of each rank's stages from one build of them."""
    ranks = world_size // pp  # of a stage: tp x cp x the data-parallel ones
    pipeline = _pipeline_keys(base, pp)
    layouts = _layouts(base, hf_config, pp, ranks, hw.per_node)
    if not layouts:
        return []
    configs = [
        typed(
            OmegaConf.merge(
                base,
                {
                    "parallel": {"tp": tp, "sequence_parallel": None, "ep": ep, "cp": cp, **pipeline},
                    "sharding": {"replicate": 1, "reshard_after_forward": None, "cpu_offload": False, **keys},
                    # A micro-batch of one: each rank's run is planned with the searched micro-batches below.
                    "trainer": {"micro_batch_size": 1} if pp > 1 else {},
                },
            )
        )
        for tp, ep, cp, keys in layouts
    ]
    try:  # one model build for every sharding's plan, for each pipeline rank
        by_rank = [summaries_by_sharding(configs, planned, stage) for stage in range(pp)]
    except ConfigError:  # too few layers for pp ranks (without stages: the model's own error, the user's)
        if pp == 1:
            raise
        return []
    chunks = chunkable(base, hf_config) if pp == 1 else (1,)
    found = []
    for i, ((tp, ep, cp, keys), variant) in enumerate(zip(layouts, configs)):
        stages = [(by_rank[stage][i], run_settings(variant, world_size, device_type, stage)) for stage in range(pp)]
        named = {
            "parallel.pp": pp,
            "parallel.tp": tp,
            "parallel.ep": ep,
            "parallel.cp": cp,
            "sharding": keys["strategy"],
            "sharding.replicate": keys.get("replicate"),
            "sharding.reshard_after_forward": keys.get("reshard_after_forward"),
            **{f"parallel.{k}": v for k, v in pipeline.items() if k not in ("pp", "pp_split_points")},
        }
        # On a CPU the state is in host memory already: nothing to offload; nor with tp, ep, cp or pp (refused).
        offloads = (False, True) if device_type == "cuda" and tp == ep == cp == pp == 1 else (False,)
        per_rank = base.trainer.global_batch_size // (ranks // tp // cp)
        for each, settings in variants(stages, per_rank, chunks, offloads, variant.parallel.pp_schedule):
            found.append(_candidate({**named, **settings}, each, hw))
    return found


def fit(found: list[Candidate], room: Budget, base: DictConfig) -> list[Candidate]:
    """Those whose peak fits the budget, fastest first, less those another listed one beats in speed and peak both;
    ConfigError naming the smallest peak when none fits."""
    fitting: list[Candidate] = []
    for c in found:
        # A config no faster than one listed (found is fastest first, the plainest first among equals) and no
        # smaller: left out. What remains is each speed's smallest peak.
        if c.memory.peak <= room.usable and all(k.memory.peak > c.memory.peak for k in fitting):
            fitting.append(c)
    if not fitting:
        smallest = min(found, key=lambda c: c.memory.peak)
        raise ConfigError(
            "--fit",
            f"no config fits {room} per rank; the smallest peak is {smallest.memory.peak / GIB:.2f} GiB "
            f"({' '.join(smallest.overrides(base))})",
            "a larger cap, more ranks (world_size=N), a smaller trainer.global_batch_size or data.seq_len",
        )
    return fitting


@dataclass(frozen=True)
class Advice:
    """What --fit would pick for a device's memory, against the config as it is."""

    best: Candidate
    overrides: tuple[str, ...]
    # The config as it is: its predicted tokens/s and peak.
    tokens_per_s: float
    peak: int
    room: Budget
    device: str


def advise(
    cfg: DictConfig, world_size: int, hw: Hardware, room: Budget, planned: tuple[nn.Module, ShardingPlan] | None = None
) -> Advice | None:
    """--fit's pick for the budget without pipeline stages, and the running config's predicted tokens/s; None when
    nothing fits. `planned`: cfg's model as the trainer planned it (before sharding), which every summary then reads:
    no model built here."""
    # Without pipeline stages: a build of each rank's would be the run's start-up's cost.
    found = candidates(cfg, world_size, "cuda" if hw.overlap else "cpu", hw, planned, stages=False)
    try:
        best = fit(found, room, cfg)[0]
    except ConfigError:
        return None
    summary = summarize(cfg, *planned, build_hf_config(cfg.model)) if planned else summary_for(cfg)
    run = run_settings(cfg, world_size, "cuda" if hw.overlap else "cpu")
    this = tokens_per_second(run, step_time(summary, run, hw))
    return Advice(best, tuple(best.changes(cfg)), this, memory(summary, run).peak, room, hw.name)


def doctor_fit(
    cfg: DictConfig, world_size: int, device: torch.device, planned: tuple[nn.Module, ShardingPlan] | None = None
) -> dict | None:
    """What the doctor's fit check reads: --fit's pick for doctor.fit_gpu's memory, or the CUDA device's this
    run trains on, less doctor.fit_headroom; None on CPU without doctor.fit_gpu, for a GPU not in the table, or
    when nothing fits. `planned`: the run's model as planned, before sharding (see advise)."""
    if not cfg.doctor.fit:
        return None
    if cfg.doctor.fit_gpu:
        chosen = gpu(cfg.doctor.fit_gpu)
        cap = chosen.memory_gib
    elif device.type == "cuda":
        chosen = gpu_named(torch.cuda.get_device_name(device))
        cap = torch.cuda.get_device_properties(device).total_memory / GIB
    else:
        return None
    if chosen is None:
        return None
    link = "nvlink" if world_size <= chosen.per_node else "ib"
    hw = gpu_hardware(chosen, dtypes(cfg.precision)[0].itemsize, link, cpu_optimizer_rate())
    try:
        advice = advise(cfg, world_size, hw, budget(cap, cfg.doctor.fit_headroom, gpu=True), planned)
    except Exception as err:  # advice, never a reason to stop: a config the planner cannot search
        log.warning(f"doctor: the fit check could not plan this config ({type(err).__name__}: {err})")
        return None
    if advice is None:
        return None
    return {
        "overrides": " ".join(advice.overrides),
        "tokens_per_s": advice.best.tokens_per_s,
        "this_tokens_per_s": advice.tokens_per_s,
        "this_peak_gib": round(advice.peak / GIB, 2),
        "cap_gib": round(cap, 1),
        "usable_gib": round(advice.room.usable / GIB, 2),
        "device": advice.device,
    }
