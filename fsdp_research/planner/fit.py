"""plan --fit: every combination of the knobs that decide memory and speed (tensor parallel within a node, expert and
context parallel, sharding and hsdp replicas, reshard to k ranks, activation checkpointing, micro-batch, prefetch
depth, cpu_offload, loss chunks) planned from one model build, those whose predicted peak fits the cap (less its
headroom: planner.budget) ranked by predicted tokens/s."""

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from fsdp_research.config.schema import typed
from fsdp_research.config.targets import resolve
from fsdp_research.data.pipeline import packed
from fsdp_research.distributed.context_parallel import SPLITTABLE, unsplittable
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.sharding import ShardingPlan
from fsdp_research.distributed.tensor_parallel import STYLES
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.hardware import gpu, gpu_named
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.planner.budget import Budget, budget
from fsdp_research.planner.calibrate import cpu_optimizer_rate
from fsdp_research.planner.memory import Memory, memory
from fsdp_research.planner.run import Run, run_settings
from fsdp_research.planner.summary import ModelSummary, summaries_by_sharding, summarize, summary_for
from fsdp_research.planner.timing import Hardware, StepTime, gpu_hardware, step_time, tokens_per_second

GIB = 2**30
log = logging.getLogger("fsdp_research")
# activation_checkpointing options: the group's option name, the summary's checkpointed blocks and selective mode.
_CHECKPOINTING = {"none": (0, 0), "every_block": (1, 0), "every_2nd": (2, 0), "selective": (1, 2)}
PREFETCH = (0, 1, 2)
CHUNKS = (1, 8)
# Config attributes of families that change their logits after the output layer: no chunks for them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


# The groups and keys a candidate sets: a base's own overrides of them, and of their keys, give way.
SEARCHED = ("parallel", "sharding", "activation_checkpointing", "trainer.micro_batch_size", "loss.chunks")
# Tensor-parallel sizes searched (within a node; sequence parallel on with it).
TP = (1, 2, 4, 8)
# Expert-parallel sizes searched (an MoE; dividing the shard dimension and the experts).
EP = (1, 2, 4, 8, 16, 32, 64)
# Context-parallel sizes searched (tp x cp within a node), for sequences of LONG tokens or more: shorter ones'
# activations are small beside the rest, and the search would take 4 times as long.
CP = (1, 2, 4, 8)
LONG = 8192
# Config attributes naming an MoE layer's routed experts.
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts")


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
        )

    def keys(self) -> dict[str, Any]:
        """The config keys that make it, spelled out (the groups' options as the keys they set)."""
        s = self.settings
        stride, selective = _CHECKPOINTING[s["activation_checkpointing"]]
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shardings(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    """The sharding keys of every sharding worth searching at this world size."""
    for strategy in ("blockwise", "reshard_all", "no_reshard"):
        yield {"strategy": strategy}
    for replicas in _divisors(world)[1:-1]:
        yield {"strategy": "hsdp", "replicate": replicas}
    for k in _divisors(world)[1:-1]:
        if k <= per_node:
            yield {"strategy": "blockwise", "reshard_after_forward": k}


def _tps(cfg: DictConfig, hf_config, world: int, per_node: int) -> list[int]:
    """The tp sizes worth searching: within a node, dividing the world, the heads, the KV heads, the MLP width and
    the sequence (sequence parallel), for a family with a plan (a model of one's own: none)."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or cfg.parallel.tp_plan
    sizes = [getattr(hf_config, k, 0) for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size")]
    if not plan or not set(plan.values()) <= set(STYLES) or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    return [
        t for t in TP if t <= per_node and not world % t and not cfg.data.seq_len % t and not any(s % t for s in sizes)
    ]


def _eps(cfg: DictConfig, hf_config, world: int, tp: int, keys: dict[str, Any]) -> list[int]:
    """The ep sizes worth searching for a sharding: an MoE's, without tp, CPU offload or LoRA, dividing its shard
    dimension and its experts."""
    experts = next((n for k in _EXPERTS if isinstance(n := getattr(hf_config, k, None), int)), 0)
    if not experts or tp > 1 or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    shard = world // tp // keys.get("replicate", 1) if keys["strategy"] != "ddp" else 1
    return [e for e in EP if not shard % e and not experts % e]


def _cps(cfg: DictConfig, hf_config, world: int, tp: int, keys: dict[str, Any], per_node: int) -> list[int]:
    """The cp sizes worth searching for a sharding: long sequences of a family whose attention splits, on windows of
    tokens, without CPU offload or LoRA; tp x cp within a node, cp dividing the shard dimension, the heads per tp
    rank, the sequence in 2 x cp chunks (and tp x cp shards) and the global batch over the data-parallel ranks
    left."""
    seq, heads = cfg.data.seq_len, getattr(hf_config, "num_attention_heads", 0)
    if seq < LONG or not heads or packed(cfg.data) or unsplittable(hf_config, seq):
        return [1]
    if not _objective_takes(cfg, "splits_sequences"):
        return [1]
    attention = getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in SPLITTABLE or cfg.trainer.compile or cfg.sharding.cpu_offload or cfg.model.lora.r is not None:
        return [1]
    shard, batch = world // tp // keys.get("replicate", 1), cfg.trainer.global_batch_size
    return [
        c
        for c in CP
        if tp * c <= per_node
        and not (shard % c or (heads // tp) % c or seq % (2 * c * tp) or batch % max(1, world // tp // c))
    ]


def _checkpointed(n_blocks: int, stride: int) -> tuple[bool, ...]:
    return tuple(stride > 0 and i % stride == 0 for i in range(n_blocks))


def _objective_takes(cfg: DictConfig, flag: str) -> bool:
    """Whether the run's objective takes what a knob changes (objectives.Objective's flags: cp's chunks of each
    sequence, the loss group's chunks): --fit searches only what the run would not refuse."""
    return bool(getattr(resolve(cfg.objective._target_, "objective._target_"), flag, False))


def _chunkable(cfg: DictConfig, hf_config) -> tuple[int, ...]:
    transforms = any(getattr(hf_config, key, None) for key in _LOGIT_TRANSFORMS)
    lm = _objective_takes(cfg, "uses_loss_group")
    return (1,) if cfg.loss.get("_target_") or transforms or not lm else CHUNKS


def _variants(
    summary: ModelSummary, run: Run, per_rank: int, chunks: tuple[int, ...], offloads: tuple[bool, ...]
) -> Iterator[tuple[ModelSummary, Run, dict[str, Any]]]:
    for option, (stride, selective) in _CHECKPOINTING.items():
        ckpt = replace(summary, checkpointed=_checkpointed(summary.n_blocks, stride), selective_every=selective)
        for micro, depth, offload, chunk in itertools.product(
            _divisors(per_rank), [d for d in PREFETCH if d < summary.n_blocks], offloads, chunks
        ):
            planned = replace(
                run,
                micro_batch=micro,
                micro_steps=per_rank // micro,
                prefetch_forward=depth,
                prefetch_backward=depth,
                cpu_offload=offload,
                foreach=run.foreach and not offload,
                loss_chunks=chunk,
            )
            settings = {
                "activation_checkpointing": option,
                "trainer.micro_batch_size": micro,
                "sharding.prefetch_forward": depth,
                "sharding.prefetch_backward": depth,
                "sharding.cpu_offload": offload,
                "loss.chunks": chunk,
            }
            yield ckpt, planned, settings


def candidates(
    cfg: DictConfig,
    world_size: int,
    device_type: str,
    hw: Hardware,
    planned: tuple[nn.Module, ShardingPlan] | None = None,
) -> list[Candidate]:
    """Every combination planned, fitting or not, fastest first (ties: the smaller peak); from `planned` (cfg's
    model as planned, before sharding) where given, else from a model built here."""
    plain = {"stride": 0, "mode": "full"}
    base = typed(
        OmegaConf.merge(
            cfg, {"activation_checkpointing": plain, "sharding": {"prefetch_forward": 0, "prefetch_backward": 0}}
        )
    )
    base.sharding.reshard_override = {}
    hf_config = build_hf_config(base.model)
    chunks = _chunkable(base, hf_config)
    shardings = [
        (tp, ep, cp, keys)
        for tp in _tps(base, hf_config, world_size, hw.per_node)
        for keys in _shardings(world_size // tp, hw.per_node // tp)
        for ep in _eps(base, hf_config, world_size, tp, keys)
        for cp in _cps(base, hf_config, world_size, tp, keys, hw.per_node)
    ]
    variants = [
        typed(
            OmegaConf.merge(
                base,
                {
                    "parallel": {"tp": tp, "sequence_parallel": None, "ep": ep, "cp": cp},
                    "sharding": {"replicate": 1, "reshard_after_forward": None, "cpu_offload": False, **keys},
                },
            )
        )
        for tp, ep, cp, keys in shardings
    ]
    found = []
    # One model build for every sharding's plan.
    for (tp, ep, cp, keys), variant, summary in zip(shardings, variants, summaries_by_sharding(variants, planned)):
        run = run_settings(variant, world_size, device_type)
        per_rank = base.trainer.global_batch_size // (world_size // tp // cp)
        named = {
            "parallel.tp": tp,
            "parallel.ep": ep,
            "parallel.cp": cp,
            "sharding": keys["strategy"],
            "sharding.replicate": keys.get("replicate"),
            "sharding.reshard_after_forward": keys.get("reshard_after_forward"),
        }
        # On a CPU the state is in host memory already: nothing to offload; nor with tp, ep or cp (refused).
        offloads = (False, True) if device_type == "cuda" and tp == ep == cp == 1 else (False,)
        for ckpt, planned, settings in _variants(summary, run, per_rank, chunks, offloads):
            time = step_time(ckpt, planned, hw)
            found.append(
                Candidate({**named, **settings}, memory(ckpt, planned), time, tokens_per_second(planned, time))
            )
    return sorted(found, key=lambda c: (-c.tokens_per_s, c.memory.peak, c.extras))


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
    """--fit's pick for the budget, and the running config's predicted tokens/s; None when nothing fits. `planned`:
    cfg's model as the trainer planned it (before sharding), which every summary then reads: no model built here."""
    found = candidates(cfg, world_size, "cuda" if hw.overlap else "cpu", hw, planned)
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
