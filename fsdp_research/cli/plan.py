"""fsdp-research plan <overrides...> [world_size=N] [--compare] [--device cpu|cuda] [--gpu NAME] [--link L]
[--fit SIZE [--headroom SHARE] [--top K] [--measure]]: per-rank memory, per-step communication and (on a GPU of the
table) predicted step time of a config, without allocating the model; --compare puts every sharding side by side;
--fit searches the knobs (sharding, reshard to k ranks, checkpointing, micro-batch, prefetch, cpu_offload, loss
chunks) for the configs whose peak fits SIZE per rank (80 or 80GiB, 80G, 81920MiB) less --headroom (default 10%)
and on a GPU the CUDA context, fastest first, and ends with `best: <overrides>` for train.py; --measure runs the
top few on world_size local processes and ranks them by measured speed."""

import argparse
import dataclasses
import datetime
import os
import sys
from collections.abc import Sequence

from omegaconf import DictConfig
from torch.multiprocessing import ProcessExitedException

from fsdp_research.cli.common import checked_config, fail, split_launch
from fsdp_research.config.data_schema import DataConfig
from fsdp_research.config.schema import Strategy
from fsdp_research.config.sizes import parse_size
from fsdp_research.distributed.precision import dtypes
from fsdp_research.distributed.processes import device_for
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.jobs.launch import run_spawned
from fsdp_research.metrics.hardware import GPUS, LINKS, Device, gpu
from fsdp_research.metrics.sinks import read_records
from fsdp_research.planner.budget import DEFAULT_HEADROOM, GIB, Budget, budget, parse_headroom
from fsdp_research.planner.calibrate import calibrate_cpu, cpu_optimizer_rate
from fsdp_research.planner.fit import Candidate, candidates, fit, unsearched
from fsdp_research.planner.format import format_compare, format_fit, format_plan, format_stages, format_time
from fsdp_research.planner.memory import memory
from fsdp_research.planner.run import Run, run_settings
from fsdp_research.planner.summary import ModelSummary, summaries_by_sharding, summary_for
from fsdp_research.planner.timing import Hardware, gpu_hardware, step_time

MEASURED = 3
MEASURE_STEPS = 5


def _compare_configs(overrides: Sequence[str], world_size: int) -> list:
    configs = []
    for strategy in Strategy:
        options = [f"sharding={strategy.value}"]
        if strategy is Strategy.hsdp:
            if world_size < 4 or world_size % 2:
                continue  # hsdp needs two replicas of at least two shards each
            options.append("sharding.replicate=2")
        configs.append(compose([*overrides, *options]))
    return configs


def _searchable(overrides: list[str], world_size: int) -> list[str]:
    """--fit searches the micro-batch: a base whose own micro-batch does not divide its batch per rank is planned
    with one micro-batch per step instead of refused."""
    t = compose(overrides).trainer
    world_size = world_size or 1
    if t.global_batch_size % world_size == 0 and t.global_batch_size % (t.micro_batch_size * world_size):
        return [*overrides, f"trainer.micro_batch_size={t.global_batch_size // world_size}"]
    return overrides


def _timing_device(args, device_type: str, world_size: int, room: Budget | None, notes: list[str]) -> Device | None:
    """The GPU of the table a timed plan is for (None: this machine's CPU, measured), checked before anything is
    planned or printed: a bad --gpu or more CPU processes than cores is the command's one line."""
    if device_type == "cuda":
        return _device(args, room, notes)
    cores = os.cpu_count() or 1
    if world_size > cores:
        raise ConfigError(
            "world_size",
            f"{world_size} CPU processes cannot be measured on this machine's {cores} cores",
            "plan for GPUs: --device cuda --gpu NAME (or --gpu NAME alone)",
        )
    return None


def _hardware(args, cfg: DictConfig, m: ModelSummary, world_size: int, device: Device | None) -> Hardware:
    """A GPU of the table (--gpu, --link), or this machine's CPU rates measured on world_size processes."""
    compute = dtypes(cfg.precision)[0]
    if device is not None:
        link = args.link or ("nvlink" if world_size <= device.per_node else "ib")
        return gpu_hardware(device, compute.itemsize, link, cpu_optimizer_rate())
    print(f"measuring this machine's CPU rates on {world_size} process(es)...", file=sys.stderr)
    rows = cfg.trainer.micro_batch_size * cfg.data.seq_len
    return calibrate_cpu(world_size, rows, m.hidden, m.intermediate, compute)


def _device(args, room: Budget | None, notes: list[str]) -> Device:
    """--gpu's device of the table (h100 by default), with --gpu-memory and --gpu-tflops for a card it lacks; a
    note where the cap says the card is smaller than the one planned for."""
    try:
        device = gpu(args.gpu or "h100")
    except KeyError as err:
        raise ConfigError(
            "--gpu", err.args[0], f"use --gpu {' | '.join(GPUS)}, or --gpu-memory and --gpu-tflops"
        ) from None
    changes = {}
    if args.gpu_memory is not None:
        changes["memory_gib"] = (
            parse_size(args.gpu_memory, "--gpu-memory", "use e.g. --gpu-memory 24GiB", unit=GIB) / GIB
        )
    if args.gpu_tflops is not None:
        if args.gpu_tflops <= 0:
            raise ConfigError(
                "--gpu-tflops", f"{args.gpu_tflops} is not a rate", "give its dense bf16 TFLOP/s, e.g. 120"
            )
        changes["bf16_tflops"] = args.gpu_tflops
    if changes:
        device = dataclasses.replace(device, name=f"{device.name} (as given)", **changes)
    elif args.gpu is None and room is not None and room.cap_gib < 0.9 * device.memory_gib:
        notes.append(
            f"note: --fit {args.fit} at an {device.name}'s speed ({device.memory_gib:g} GiB): for a smaller card give "
            f"--gpu ({', '.join(GPUS)}) or --gpu-memory and --gpu-tflops"
        )
    return device


def _measure(overrides: Sequence[str], found: Sequence[Candidate], base: DictConfig, world_size: int) -> list:
    """(measured tokens/s, candidate) of each, from a short run on world_size local processes, fastest first."""
    root = os.path.join("outputs", "plan", datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f"))
    measured = []
    for index, candidate in enumerate(found):
        cfg = compose(
            [
                *overrides,
                *candidate.overrides(base),
                "logger=none",
                "trainer.eval_interval=0",
                "trainer.log_interval=1",
                f"trainer.max_steps={MEASURE_STEPS}",
                "checkpoint.interval=0",
                "checkpoint.export=false",
                "checkpoint.resume=never",
            ]
        )
        run_dir = os.path.join(root, str(index))
        run_spawned(cfg, world_size, run_dir)
        summary = next(r["summary"] for r in reversed(read_records(run_dir)) if "summary" in r)
        measured.append((summary["median_tokens_per_s"], candidate))
    print(f"run dirs: {root}/<n>/")
    return sorted(measured, key=lambda pair: -pair[0])


def _budget(args, gpu_plan: bool) -> Budget | None:
    """--fit's cap (a bare number: GiB) less --headroom; None without --fit."""
    if args.fit is None:
        if args.headroom is not None:
            raise ConfigError("--headroom", "it is what --fit keeps free", "add --fit <GiB per rank>")
        return None
    cap = parse_size(args.fit, "--fit", "use --fit <memory per rank>, e.g. 80, 80GiB, 80G or 81920MiB", unit=GIB) / GIB
    if cap <= 0:
        raise ConfigError("--fit", f"{args.fit} is not a memory cap", "use --fit <memory per rank>, e.g. 80, 80GiB")
    headroom = DEFAULT_HEADROOM if args.headroom is None else parse_headroom(args.headroom, "--headroom")
    return budget(cap, headroom, gpu_plan)


def _fit(
    args, room: Budget, overrides: list[str], cfg: DictConfig, m: ModelSummary, world_size: int, hw: Hardware
) -> None:
    """The search, the top configs, the measured re-ranking, the `best:` line. The base's own settings of the
    searched knobs give way: each row's overrides, after the base's others, make that config."""
    device_type = "cuda" if hw.overlap else "cpu"
    found = candidates(cfg, world_size, device_type, hw)
    base_overrides = unsearched(overrides)
    base = compose(base_overrides)
    fitting = fit(found, room, base)
    head = f"{m.name} on {world_size} rank(s) of {hw.name}"
    print("\n".join(format_fit(fitting, found, room, args.top, base, head)))
    best = fitting[0]
    if args.measure:
        top = fitting[: min(args.top, MEASURED)]
        print(f"\nmeasured: the top {len(top)} for {MEASURE_STEPS} steps each on {world_size} local process(es)")
        measured = _measure(base_overrides, top, base, world_size)
        for rank, (tokens_per_s, c) in enumerate(measured, 1):
            print(
                f"{rank:>4}  {tokens_per_s:>10,.0f} tokens/s measured ({c.tokens_per_s:,.0f} predicted)  "
                + " ".join(c.overrides(base))
            )
        best = measured[0][1]
    # As train.py takes it: the ranks of a node from distributed.nproc_per_node; more nodes from their launcher.
    ranks = [f"distributed.nproc_per_node={min(world_size, hw.per_node)}"] if world_size > 1 else []
    if world_size > hw.per_node:
        print(f"on {-(-world_size // hw.per_node)} nodes of {hw.per_node}: launch with srun (slurm/train.sbatch)")
    print("best: " + " ".join([*base_overrides, *ranks, *best.overrides(base)]))


def _largest_stage(cfg: DictConfig, world_size: int, device_type: str) -> tuple[ModelSummary, Run]:
    """Every pipeline rank's plan, printed as a line of peaks; the largest's, planned in full."""
    stages = [(summary_for(cfg, s), run_settings(cfg, world_size, device_type, s)) for s in range(cfg.parallel.pp)]
    peaks = [memory(m, run).peak for m, run in stages]
    largest = max(range(len(stages)), key=peaks.__getitem__)
    print(format_stages(cfg.parallel, stages[0][1], peaks, largest))
    return stages[largest]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-research plan", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides as for train.py, and world_size=N (default: as the launch would have)",
    )
    parser.add_argument("--compare", action="store_true", help="also compare every sharding option")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="the device type to plan for (default: the trainer's, trainer.device)"
    )
    parser.add_argument("--gpu", help=f"{', '.join(GPUS)} (default h100; implies --device cuda)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="a card the table lacks: its memory (24GiB; implies cuda)")
    parser.add_argument(
        "--gpu-tflops", type=float, help="a card the table lacks: its dense bf16 TFLOP/s (implies cuda)"
    )
    parser.add_argument(
        "--link", choices=LINKS, help="what GPUs talk over (default: nvlink up to a node's GPUs, else ib)"
    )
    parser.add_argument(
        "--fit", metavar="SIZE", help="search the configs whose peak fits SIZE per rank (80 = 80GiB; 80G, 81920MiB)"
    )
    parser.add_argument(
        "--headroom",
        metavar="SHARE",
        help=f"with --fit: the share of SIZE kept free (default {DEFAULT_HEADROOM:g}; 0.15 or 15%%), beside the CUDA "
        "context on a GPU",
    )
    parser.add_argument("--top", type=int, default=5, help="with --fit: how many configs to show (default 5)")
    parser.add_argument("--measure", action="store_true", help="with --fit: run the top few and rank them measured")
    return parser


def _device_type(args, cfg: DictConfig, overrides: Sequence[str], notes: list[str]) -> str:
    """cuda where a flag names a GPU, else --device, else the trainer's; a note where the plan's sequence length is
    the data group's default."""
    given_gpu = args.gpu or args.link or args.gpu_memory is not None or args.gpu_tflops is not None
    if args.device == "cpu" and given_gpu:
        raise ConfigError("--gpu", "--gpu, --gpu-* and --link plan for GPUs, not --device cpu", "drop --device cpu")
    if cfg.data.seq_len == DataConfig.seq_len and not any(o.startswith("data.seq_len=") for o in overrides):
        notes.append(
            f"note: planned at data.seq_len={cfg.data.seq_len}, the data group's default: give the sequence "
            "length you will train with (data.seq_len=...)"
        )
    return args.device or ("cuda" if given_gpu else device_for(cfg.trainer.device, 0).type)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        if args.top < 1:
            raise ConfigError("--top", f"{args.top} is below 1", "use --top K, K >= 1")
        if args.measure and args.fit is None:
            raise ConfigError("--measure", "it measures the configs --fit finds", "add --fit <GiB per rank>")
        launch, overrides = split_launch(args.overrides)
        if args.fit is not None:
            overrides = _searchable(overrides, launch.get("world_size", 0))
        cfg, _, world_size = checked_config(overrides, launch.get("world_size", 0), stages=True)
        if cfg.parallel.pp > 1 and args.compare:
            raise ConfigError("parallel.pp", "--compare does not compare pipeline stages' shardings yet", "drop one")
        notes: list[str] = []  # printed after the plan, whose first line is the model's
        device_type = _device_type(args, cfg, overrides, notes)
        room = _budget(args, device_type == "cuda")
        timed = device_type == "cuda" or args.fit is not None
        device = _timing_device(args, device_type, world_size, room, notes) if timed else None
        others = _compare_configs(overrides, world_size) if args.compare else []
        # One model build for the plan and every row of the comparison (a large model's build is most of the time).
        if cfg.parallel.pp > 1:  # the pipeline rank whose peak is the largest
            summary, run = _largest_stage(cfg, world_size, device_type)
            summaries = [summary]
        else:
            summaries = summaries_by_sharding([cfg, *others])
            run = run_settings(cfg, world_size, device_type)
        print(format_plan(summaries[0], run))
        if timed:
            hw = _hardware(args, cfg, summaries[0], world_size, device)
            print(format_time(step_time(summaries[0], run, hw), run, hw))
        if args.compare:
            print()
            rows = [(m, run_settings(c, world_size, device_type)) for m, c in zip(summaries[1:], others)]
            print(format_compare(rows))
        for note in notes:
            print(note)
        if args.fit is not None:
            print()
            _fit(args, room, overrides, cfg, summaries[0], world_size, hw)
    except ConfigError as err:
        return fail(err)
    except ProcessExitedException as err:  # a measured run has said why on stderr
        return err.exit_code or 1
    return 0
