"""fsdp-research scaling <overrides...> [--world-sizes 1,2] [--steps 30] [--micro-batch M] [--ddp-micro-batch M]:
samples/s at each world size for the config's sharding and for DDP with the same per-device micro batch (or the
one that fits under DDP), the scaling efficiency, and the abandon verdict; scaling.json and scaling.png in --out."""

import argparse
import json
import os
import tempfile
from collections.abc import Sequence

from fsdp_research.jobs.compose import compose
from fsdp_research.tools.scaling import MEASURE, measure, plot, verdict


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research scaling", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=None, help="per-device micro batch (default: config's)")
    parser.add_argument(
        "--ddp-micro-batch", type=int, default=None, help="the micro batch that fits under ddp (default: the same)"
    )
    parser.add_argument("--out", default="outputs/scaling")
    args = parser.parse_intermixed_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    base = compose(args.overrides)
    sharding = base.sharding.strategy.value
    micro = args.micro_batch or base.trainer.micro_batch_size
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for name, batch in ((sharding, micro), ("ddp", args.ddp_micro_batch or micro)):
            if name in results:
                continue
            results[name] = {}
            for world in worlds:
                cfg = compose(
                    [
                        *MEASURE,
                        f"trainer.max_steps={args.steps}",
                        *args.overrides,
                        f"sharding={name}",
                        f"trainer.micro_batch_size={batch}",
                        f"trainer.global_batch_size={batch * world}",
                    ]
                )
                results[name][world] = measure(cfg, world, os.path.join(tmp, f"{name}_w{world}"))
    lines = verdict(results, sharding)
    print("\n".join(lines))
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump({"overrides": args.overrides, "samples_per_s": results, "report": lines}, f, indent=2)
    plot(results, os.path.join(args.out, "scaling.png"))
    print(f"wrote {args.out}/scaling.json and scaling.png")
    return 0
