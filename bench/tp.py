"""Tensor parallel against data parallel alone on the same ranks, whole runs side by side (`python train.py ...`,
alternated, each run's median step after the first few): tp=2 x dp_shard=2 (sequence parallel on, then off) against
dp_shard=4 (blockwise FSDP2) on 4 ranks, at the same global batch; step time and rank 0's peak memory (the process's
peak RSS on the CPU, the device's on a GPU), printed as ratios.

    .venv/bin/python bench/tp.py [--steps 12] [--repeats 2] [--model llama_mid] [--seq-len 256] [overrides ...]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_research.metrics.sinks import read_records  # noqa: E402

WARMUP = 3

CASES = {
    "dp_shard 4": [],
    "dp_shard 2 x tp 2, SP": ["parallel.tp=2"],
    "dp_shard 2 x tp 2, no SP": ["parallel.tp=2", "parallel.sequence_parallel=false"],
}


def _run(tmp: str, name: str, repeat: int, args) -> dict:
    run_dir = os.path.join(tmp, f"case{list(CASES).index(name)}_{repeat}")
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), f"model={args.model}", "data=synthetic", "precision=fp32",
        f"data.seq_len={args.seq_len}", "logger=none", "trainer.log_interval=1", "trainer.eval_interval=0",
        f"trainer.max_steps={args.steps}", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
        "checkpoint.save=false", "checkpoint.export=false", "distributed.nproc_per_node=4",
        f"hydra.run.dir={run_dir}", *CASES[name], *args.overrides,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)
    records = read_records(run_dir)
    steps = [r for r in records if "loss" in r and r["step"] > WARMUP]
    summary = next(r["summary"] for r in records if "summary" in r)
    return {
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "peak_gib": summary.get("peak_device_gib") or summary.get("peak_rss_gib"),
        "loss": steps[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="llama_mid")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in CASES:
                results[name].append(_run(tmp, name, repeat, args))
    print(f"{args.model}, seq_len {args.seq_len}, global batch 16 in micro-batches of 4, 4 ranks, fp32;")
    print(f"medians of {args.repeats} alternated runs of {args.steps} steps (steps > {WARMUP})")
    print(f"{'case':28} {'step s':>8} {'peak GiB':>9} {'last loss':>10}")
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    for name, m in median.items():
        print(f"{name:28} {m['step_s']:8.3f} {m['peak_gib']:9.3f} {m['loss']:10.4f}")
    base = median["dp_shard 4"]
    for name in list(CASES)[1:]:
        m = median[name]
        step, peak = m["step_s"] / base["step_s"], m["peak_gib"] / base["peak_gib"]
        print(f"{name} / dp_shard 4: step time x{step:.2f}, peak x{peak:.2f}")


if __name__ == "__main__":
    main()
