"""Per-rank memory of one real training step, by category, as torch's FSDP memory tracker
(torch.distributed._tools.fsdp2_mem_tracker) measures it: what the planner's prediction is held against."""

import functools
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

from fsdp_research.config.targets import kwargs_of
from fsdp_research.distributed.pipeline import pipeline_of
from fsdp_research.objectives.grpo import GRPO
from fsdp_research.objectives.rollouts import Sampling, generate
from tests.helpers.dist import run_distributed, run_fake
from tests.helpers.timing import prepared, train_step

# The planner's categories as sums of the tracker's.
GROUPS = {
    "sharded_params": (_FSDPRefType.SHARDED_PARAM,),
    "sharded_grads": (_FSDPRefType.SHARDED_GRAD,),
    "gathered": (_FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER),
    "unsharded_grads": (_FSDPRefType.UNSHARDED_GRAD, _FSDPRefType.REDUCE_SCATTER),
    "activations": (_FSDPRefType.ACT,),
    "temporaries": (_FSDPRefType.TEMP,),
    "activations_and_temporaries": (_FSDPRefType.ACT, _FSDPRefType.TEMP),
    # The optimizer's state with what its step allocates (the tracker files both as optimizer state).
    "optimizer_step": (_FSDPRefType.OPT,),
    "peak": ("Total",),
}


class _GroupPeaks(FSDPMemTracker):
    """The tracker, plus each group's own peak over the step (its peak snapshot only holds the categories at the
    moment of the total's peak) and the optimizer state held between steps."""

    def __enter__(self) -> "_GroupPeaks":
        tracker = super().__enter__()
        self.peaks = dict.fromkeys(GROUPS, 0)
        self.peaks["optimizer"] = sum(snap[_FSDPRefType.OPT] for snap in self.get_tracker_snapshot().values())
        return tracker

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        for snap in self._curr_mem_snap.values():
            for group, keys in GROUPS.items():
                self.peaks[group] = max(self.peaks[group], sum(snap.get(k, 0) for k in keys))


def _first_update(model, optimizer) -> None:
    """The optimizer's state as a first step leaves it, without the step's compute (zero gradients, one update): the
    tracked step is then the steady state. The tracker measured the same bytes in every group after it as after a
    real first step (fp32 llama_tiny, llama_mid, selective, Muon; 2026-12-04), at half the time: bf16 matmuls have no
    fast path on CPUs without AVX-512 BF16 (a llama_mid step takes a minute there)."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _afresh(tracker: FSDPMemTracker, module: torch.nn.Module, args: tuple) -> None:
    tracker.memory_tracking.pop(module, None)


def _tracked(model, optimizer, fn, inputs: tuple = ()) -> dict[str, int]:
    """The groups' peaks while fn() runs (`inputs` counted as the step's)."""
    tracker = _GroupPeaks(model, optimizer)
    tracker.track_inputs(inputs)
    with tracker:
        # The tracker refuses a top-level module called again in a step, for its per-module statistics (a pipeline
        # stage's, once a micro-batch; a generation's, once a token): each call starts them afresh (a hook ahead of
        # the tracker's); the groups' peaks are the whole step's.
        again = model.register_forward_pre_hook(functools.partial(_afresh, tracker), prepend=True)
        fn()
        again.remove()
    return tracker.peaks


def _grpo_peaks(cfg, model, optimizer, batches: list[torch.Tensor]) -> dict[str, dict[str, int]]:
    """GRPO's two parts, each tracked: a micro-batch's generation (prompts of data.seq_len tokens, each completed to
    max_completion_length: no token stops it) and the update on rollouts as such a step leaves them (random tokens,
    through GRPO's own loss)."""
    o, n, gen = cfg.objective, cfg.trainer.micro_batch_size, torch.Generator().manual_seed(0)
    vocab, prompt, width = model.config.vocab_size, cfg.data.seq_len, o.max_completion_length
    prompts = torch.randint(0, vocab, (n, prompt), generator=gen)
    real, keys, sampling = torch.ones_like(prompts, dtype=torch.bool), torch.arange(n), Sampling(width)
    generation = _tracked(
        model,
        optimizer,
        lambda: generate(model, prompts, real, keys, sampling, set(), 0, o.gather_for_generation),
        (prompts,),
    )
    objective, count = GRPO(**kwargs_of(o, exclude=("name",))), n * len(batches)
    tokens = torch.randint(0, vocab, (count, prompt + width), generator=gen)
    objective.step = {
        "tokens": tokens,
        "attention": torch.ones_like(tokens),
        "ids": tokens[:, prompt:],
        "mask": torch.ones(count, width, dtype=torch.bool),
        "advantages": torch.randn(count, generator=gen),
    }
    objective.extremes = torch.tensor([1.0, 0.0], dtype=torch.float64)
    rows = list(torch.arange(count)[:, None].split(n))
    update = functools.partial(train_step, model, optimizer, rows, cfg, objective, torch.tensor(1.0))
    step = _tracked(model, optimizer, update, tuple(objective.step.values()))
    return {"generation": generation, "step": step}


def _measure_each(configs: dict[str, Any]) -> dict[str, dict[str, int]]:
    peaks = {}
    for name, container in configs.items():
        cfg, model, optimizer, batches = prepared(container)
        if pipeline_of(model):  # a real first step: the stages infer their shapes in it by autograd.grad, which
            train_step(model, optimizer, batches, cfg)  # the tracker's hooks refuse
        else:
            _first_update(model, optimizer)
        if cfg.objective.name == "grpo":
            peaks[name] = _grpo_peaks(cfg, model, optimizer, batches)
        else:
            step = functools.partial(train_step, model, optimizer, batches, cfg)
            peaks[name] = _tracked(model, optimizer, step, tuple(batches))
        if cfg.parallel.pp > 1:  # each stage's, from its first rank (pp is the mesh's outermost axis)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, peaks[name])
            peaks[name] = {"stages": every[:: len(every) // cfg.parallel.pp]}
        del model, optimizer
        gc.collect()
    return peaks


def _measure_each_on_a_core(configs: dict[str, Any]) -> dict[str, dict[str, int]]:
    torch.set_num_threads(1)
    return _measure_each(configs)


def measure_step_memory(configs: dict[str, Any], world_size: int, fake: bool = False) -> dict[str, dict[str, int]]:
    """Rank 0's peak bytes per group (and the optimizer state) in one tracked step of each config (pipeline
    parallel: {"stages": each stage's first rank's}), all on the same
    `world_size` processes (gloo, CPU; the ranks hold equal shares), or, with `fake`, as rank 0 of `world_size`
    fake ranks, in two processes (what a rank allocates depends on shapes alone, except where the data sets them)."""
    containers = {name: OmegaConf.to_container(cfg, resolve=True) for name, cfg in configs.items()}
    if not fake:
        return run_distributed(_measure_each, world_size, containers)
    # Two processes, each rank 0 of the fake ranks for every other config on one core (the planner's: 23.5 s,
    # against 27.6 s in one process of torch's default two threads; two such processes: 67 s). The same bytes as in
    # one process, checked: all but cp 2 x tp 2's activations, 2 KiB more of 101 MB (as real ranks allocate too).
    names = list(containers)
    shares = [{name: containers[name] for name in names[first::2]} for first in (0, 1) if names[first:]]
    with ThreadPoolExecutor(2) as pool:
        found = [*pool.map(lambda share: run_fake(_measure_each_on_a_core, world_size, share), shares)]
    merged = {name: peaks for share in found for name, peaks in share.items()}
    return {name: merged[name] for name in names}
