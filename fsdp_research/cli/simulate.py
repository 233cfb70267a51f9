"""fsdp-research simulate <overrides...> world_size=N [rank=R] [--json PATH] [--scratch DIR]: rank R (default 0)
of an N-rank job, run alone in this process on torch's fake process-group backend: the real sharding plan,
shard sizes, initialisation, optimizer state, DCP save plan and export part, each phase's time and memory beside
the planner's prediction (fsdp_research.tools.simulate). Validates a large job's set-up on one machine before it is
paid for."""

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

import torch.distributed as dist

from fsdp_research.cli.common import checked_config, fail, split_launch
from fsdp_research.config.schema import Strategy
from fsdp_research.distributed.processes import device_for
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.tools.simulate import Phase, as_dict, simulate

GIB = 2**30


def _rank(overrides: list[str]) -> tuple[int, list[str]]:
    rank, rest = 0, []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key != "rank":
            rest.append(arg)
        elif value.isdigit():
            rank = int(value)
        else:
            raise ConfigError("rank", f"{value!r} is not a rank", "use rank=R, 0 <= R < world_size")
    return rank, rest


def _check_rank(rank: int, world: int) -> None:
    if rank >= world:
        raise ConfigError("rank", f"{rank} is not a rank of world_size={world}", f"use rank=R, 0 <= R < {world}")


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _sizes(values: dict[str, int]) -> str:
    return ", ".join(f"{k} {_size(v)}" for k, v in values.items()) or "-"


def _table(phases: list[Phase], world: int, rank: int) -> str:
    rows = [f"rank {rank} of {world} (fake process group): wall time, host memory (GiB), this rank's tensors"]
    rows.append(f"{'phase':<31} {'s':>8} {'cpu s':>8} {'rss':>6} {'peak':>6}  {'tensors':<38} {'planner':<38} note")
    for p in phases:
        device = f"; device peak {p.device_peak_gib:.2f} GiB" if p.device_peak_gib is not None else ""
        rows.append(
            f"{p.name:<31} {p.seconds:>8.2f} {p.cpu_seconds:>8.2f} {p.rss_gib:>6.2f} {p.peak_rss_gib:>6.2f}  "
            f"{_sizes(p.tensors):<38} {_sizes(p.predicted):<38} {p.note}{device}"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research simulate", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides as for train.py, world_size=N and rank=R")
    parser.add_argument("--json", metavar="PATH", help="also write the phases as JSON")
    parser.add_argument(
        "--scratch", metavar="DIR", help="where the export part goes, DIR/parts/ (default: a temporary dir, removed)"
    )
    args = parser.parse_intermixed_args(argv)
    try:
        cfg, hf_config, world, rank = _checked(args)
    except ConfigError as err:
        return fail(err)
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    scratch = args.scratch or tempfile.mkdtemp(prefix="fsdp-simulate-")
    try:
        shutil.rmtree(os.path.join(scratch, "parts"), ignore_errors=True)  # an earlier run's part
        phases, checksum = simulate(cfg, hf_config, device_for(cfg.trainer.device, 0), scratch)
    except ConfigError as err:
        return fail(err)
    finally:
        dist.destroy_process_group()
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print(_table(phases, world, rank))
    print(f"shard checksum: {checksum:.9g}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"world_size": world, "rank": rank, "checksum": checksum, "phases": as_dict(phases)}, out)
    return 0


def _checked(args) -> tuple:
    """(config, HF config, world size, rank), every input checked before anything runs."""
    launch, overrides = split_launch(args.overrides)
    if "nodes" in launch:
        raise ConfigError("nodes", "simulate runs one rank of world_size ranks", "drop nodes=, give world_size=N")
    if "world_size" not in launch:
        raise ConfigError("world_size", "is not given", "give the job's ranks, e.g. world_size=1024")
    rank, overrides = _rank(overrides)
    _check_rank(rank, launch["world_size"])
    for flag, path in (
        ("--json", args.json and os.path.dirname(os.path.abspath(args.json))),
        ("--scratch", args.scratch),
    ):
        if path and not (os.path.isdir(path) and os.access(path, os.W_OK)):
            raise ConfigError(flag, f"{path} is not a writable directory", "make it, or give another path")
    composed = compose(overrides)
    if composed.model.load_weights:
        raise ConfigError(
            "model.load_weights",
            "simulate initialises from the config (the loader's check sums over ranks, which the fake backend skips)",
            "simulate the same shapes with model.load_weights=false",
        )
    if composed.sharding.strategy == Strategy.ddp_classic:
        raise ConfigError("sharding", "ddp_classic is torch's DDP, which simulate does not set up", "use sharding=ddp")
    cfg, hf_config, world = checked_config(overrides, launch["world_size"], stages=True)
    return cfg, hf_config, world, rank
