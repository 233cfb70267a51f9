"""Scaling benchmark: samples/s on one device against N, for the chosen sharding and for plain DDP with the
same per-device micro batch, and the verdict the seed text asks for: a sharding whose throughput falls below
what DDP gives with the micro batch that fits is a configuration to abandon.

    python -m fsdp_research.scaling <overrides...> --world-sizes 1,2 [--steps 30] [--ddp-micro-batch M]
"""
import argparse
import json
import os
import statistics
import tempfile
from typing import Dict, List

from omegaconf import OmegaConf

from .config import compose
from .distributed import spawn
from .trainer import _run_worker

WARMUP_STEPS = 5


def _samples_per_s(run_dir: str) -> float:
    """Median global samples/s over the logged steps after warm-up."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return statistics.median(r["samples_per_s"] for r in rows if "samples_per_s" in r and r["step"] > WARMUP_STEPS)


def measure(overrides: List[str], world_size: int, micro_batch: int, steps: int, out: str) -> float:
    """Train `steps` steps on `world_size` processes (global batch = micro batch x world size)."""
    cfg = compose(["logger=none", "checkpoint.interval=0", "checkpoint.export=false", "trainer.eval_interval=0",
                   "trainer.log_interval=1", f"trainer.max_steps={steps}", *overrides,
                   f"trainer.micro_batch_size={micro_batch}", f"trainer.global_batch_size={micro_batch * world_size}"])
    run_dir = os.path.join(out, f"{cfg.sharding.strategy.value}_w{world_size}")
    spawn(_run_worker, world_size, OmegaConf.to_container(cfg, resolve=True), run_dir)
    return _samples_per_s(run_dir)


def verdict(results: Dict[str, Dict[int, float]], sharding: str) -> List[str]:
    lines = []
    for name, by_world in results.items():
        base = by_world[min(by_world)]
        for world, sps in sorted(by_world.items()):
            lines.append(f"{name:>10} x{world}: {sps:8.2f} samples/s, {sps / world:8.2f} per device, "
                         f"scaling efficiency {sps / (world * base / min(by_world)):.0%}")
    top = max(results[sharding])
    if sharding != "ddp" and results[sharding][top] < results["ddp"][top]:
        lines.append(f"verdict: {sharding} gives {results[sharding][top]:.2f} samples/s on {top} devices, below ddp's "
                     f"{results['ddp'][top]:.2f} with the micro batch that fits: abandon this configuration "
                     "rather than tune it (unless the model does not fit under ddp)")
    else:
        lines.append(f"verdict: {sharding} keeps up with ddp on {top} devices "
                     f"({results[sharding][top]:.2f} vs {results['ddp'][top]:.2f} samples/s)")
    return lines


def _plot(results: Dict[str, Dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_world in results.items():
        worlds = sorted(by_world)
        ax.plot(worlds, [by_world[w] for w in worlds], marker="o", label=name)
    base = results[next(iter(results))]
    ax.plot(sorted(base), [base[min(base)] * w / min(base) for w in sorted(base)], "k--", label="linear")
    ax.set_xlabel("devices")
    ax.set_ylabel("samples/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=None, help="per-device micro batch (default: config's)")
    parser.add_argument("--ddp-micro-batch", type=int, default=None,
                        help="the micro batch that fits under ddp (default: the same)")
    parser.add_argument("--out", default="outputs/scaling")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    cfg = compose(args.overrides)
    sharding = cfg.sharding.strategy.value
    micro = args.micro_batch or cfg.trainer.micro_batch_size
    os.makedirs(args.out, exist_ok=True)
    results: Dict[str, Dict[int, float]] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        for name, batch in ((sharding, micro), ("ddp", args.ddp_micro_batch or micro)):
            if name in results:
                continue
            results[name] = {w: measure([*args.overrides, f"sharding={name}"], w, batch, args.steps, tmp)
                             for w in worlds}
    lines = verdict(results, sharding)
    print("\n".join(lines))
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump({"overrides": args.overrides, "samples_per_s": results, "report": lines}, f, indent=2)
    _plot(results, os.path.join(args.out, "scaling.png"))
    print(f"wrote {args.out}/scaling.json and scaling.png")


if __name__ == "__main__":
    main()
