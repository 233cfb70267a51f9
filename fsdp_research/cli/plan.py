"""fsdp-research plan <overrides...> [world_size=N] [--compare] [--device cpu|cuda]: per-rank memory and
per-step communication of a config, without allocating the model; --compare puts every sharding side by side."""

import argparse
from collections.abc import Sequence

from ..composition import compose
from ..config import Strategy
from ..distributed import device_for
from ..errors import ConfigError
from ..planner.format import format_compare, format_plan
from ..planner.summary import run_settings, summaries_by_sharding
from .common import checked_config, fail, split_launch


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


def main(argv: Sequence[str] | None = None) -> int:
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
    args = parser.parse_intermixed_args(argv)
    try:
        launch, overrides = split_launch(args.overrides)
        cfg, _, world_size = checked_config(overrides, launch.get("world_size", 0))
        device_type = args.device or device_for(cfg.trainer.device, 0).type
        others = _compare_configs(overrides, world_size) if args.compare else []
        # One model build for the plan and every row of the comparison (a large model's build is most of the time).
        summaries = summaries_by_sharding([cfg, *others])
        print(format_plan(summaries[0], run_settings(cfg, world_size, device_type)))
        if args.compare:
            print()
            rows = [(m, run_settings(c, world_size, device_type)) for m, c in zip(summaries[1:], others)]
            print(format_compare(rows))
    except ConfigError as err:
        return fail(err)
    return 0
