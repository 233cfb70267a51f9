"""Scaling benchmark: samples/s on one device against N, for the chosen sharding and for plain DDP with the
same per-device micro batch, and the verdict the seed text asks for: a sharding whose throughput falls below
what DDP gives with the micro batch that fits is a configuration to abandon. `fsdp-research scaling` is the
command."""

import statistics

from omegaconf import DictConfig

from fsdp_research.jobs.launch import run_spawned
from fsdp_research.metrics.sinks import step_metrics

WARMUP_STEPS = 5
# What a measured run leaves out: everything but the steps (give the config trainer.max_steps).
MEASURE = [
    "logger=none",
    "checkpoint.interval=0",
    "checkpoint.export=false",
    "trainer.eval_interval=0",
    "trainer.log_interval=1",
]


def measure(cfg: DictConfig, world_size: int, run_dir: str) -> float:
    """Median global samples/s over the logged steps after warm-up of cfg on `world_size` processes (a config
    composed with MEASURE)."""
    run_spawned(cfg, world_size, run_dir)
    return statistics.median(r["samples_per_s"] for r in step_metrics(run_dir) if r["step"] > WARMUP_STEPS)


def verdict(results: dict[str, dict[int, float]], sharding: str) -> list[str]:
    lines = []
    for name, by_world in results.items():
        base = by_world[min(by_world)]
        for world, sps in sorted(by_world.items()):
            lines.append(
                f"{name:>10} x{world}: {sps:8.2f} samples/s, {sps / world:8.2f} per device, "
                f"scaling efficiency {sps / (world * base / min(by_world)):.0%}"
            )
    top = max(results[sharding])
    if sharding != "ddp" and results[sharding][top] < results["ddp"][top]:
        lines.append(
            f"verdict: {sharding} gives {results[sharding][top]:.2f} samples/s on {top} devices, below ddp's "
            f"{results['ddp'][top]:.2f} with the micro batch that fits: abandon this configuration "
            "rather than tune it (unless the model does not fit under ddp)"
        )
    else:
        lines.append(
            f"verdict: {sharding} keeps up with ddp on {top} devices "
            f"({results[sharding][top]:.2f} vs {results['ddp'][top]:.2f} samples/s)"
        )
    return lines


def plot(results: dict[str, dict[int, float]], path: str) -> None:
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
