"""Tensor and expert parallel against data parallel alone on the same ranks, whole runs side by side (`python
train.py ...`, alternated, each run's median step after the first few), at the same global batch; step time and rank
0's peak memory (the process's peak RSS on the CPU, the device's on a GPU), printed as ratios to the first case.

- `tp` (the default): llama_mid on 4 ranks, tp=2 x dp_shard=2 (sequence parallel on, then off) against dp_shard=4.
- `ep`: an MoE (qwen3_moe shapes, 8 experts, top-2) on 2 ranks, ep=2 against FSDP alone; on 4 ranks, ep=2 x
  dp_mod_ep=2 and ep=4 against FSDP alone.
- `cp` (run it with --seq-len 4096): llama_mid on 2 ranks, each sequence split over cp=2 against dp_shard=2 (each
  rank a whole sequence), a sequence per micro-batch, 2 a step.
- `pp`: llama_mid on 2 ranks, its layers split over pp=2 stages (1F1B, GPipe, InterleavedZeroBubble and ZBV with
  2 stages a rank) against dp_shard=2; rank 0's peak is the first stage's (ZBV's: the first and the last).

    .venv/bin/python bench/parallel.py [--suite tp|ep|cp|pp] [--steps 12] [--repeats 2] [--seq-len 256] [overrides ...]
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

# An MoE of qwen3_moe's shapes: 8 experts of width 256, top-2, hidden 256, 4 blocks.
MOE = [
    "model=custom", "model.model_type=qwen3_moe", "model.config.vocab_size=4096", "model.config.hidden_size=256",
    "model.config.intermediate_size=512", "model.config.moe_intermediate_size=256", "model.config.num_experts=8",
    "model.config.num_experts_per_tok=2", "model.config.num_hidden_layers=4", "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=4", "model.config.max_position_embeddings=1024",
]  # fmt: skip
BATCH = ["trainer.global_batch_size=16", "trainer.micro_batch_size=4"]
# Two stages a rank (the looped and V schedules).
LOOPED = ["parallel.pp=2", "parallel.pp_stages_per_rank=2"]
BATCH_CP = ["trainer.global_batch_size=2", "trainer.micro_batch_size=1"]
# suite -> (model and batch overrides, description, {ranks: {case: overrides}}); the first case of each world is the
# baseline.
SUITES = {
    "tp": (
        ["model=llama_mid", *BATCH],
        "llama_mid",
        {
            4: {
                "dp_shard 4": [],
                "dp_shard 2 x tp 2, SP": ["parallel.tp=2"],
                "dp_shard 2 x tp 2, no SP": ["parallel.tp=2", "parallel.sequence_parallel=false"],
            }
        },
    ),
    "ep": (
        [*MOE, *BATCH],
        "qwen3_moe shapes (8 experts, top-2, hidden 256, 4 blocks)",
        {
            2: {"dp_shard 2": [], "ep 2": ["parallel.ep=2"]},
            4: {"dp_shard 4": [], "dp_mod_ep 2 x ep 2": ["parallel.ep=2"], "ep 4": ["parallel.ep=4"]},
        },
    ),
    "cp": (
        ["model=llama_mid", "model.config.max_position_embeddings=8192", *BATCH_CP],
        "llama_mid",
        {2: {"dp_shard 2": [], "dp_shard 1 x cp 2": ["parallel.cp=2"]}},
    ),
    "pp": (
        ["model=llama_mid", *BATCH],
        "llama_mid",
        {
            2: {
                "dp_shard 2": [],
                "pp 2 (1F1B)": ["parallel.pp=2"],
                "pp 2 (GPipe)": ["parallel.pp=2", "parallel.pp_schedule=GPipe"],
                "pp 2 (InterleavedZeroBubble)": [*LOOPED, "parallel.pp_schedule=InterleavedZeroBubble"],
                "pp 2 (ZBVZeroBubble)": [*LOOPED, "parallel.pp_schedule=ZBVZeroBubble"],
            }
        },
    ),
}


def _run(tmp: str, world: int, case: list[str], run_dir: str, args) -> dict:
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), "data=synthetic", "precision=fp32",
        f"data.seq_len={args.seq_len}", "logger=none", "trainer.log_interval=1", "trainer.eval_interval=0",
        f"trainer.max_steps={args.steps}", "checkpoint.save=false", "checkpoint.export=false",
        f"distributed.nproc_per_node={world}",
        f"hydra.run.dir={run_dir}", *SUITES[args.suite][0], *case, *args.overrides,
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
    parser.add_argument("--suite", choices=list(SUITES), default="tp")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    _, model, worlds = SUITES[args.suite]
    batch = {o.split("=")[0].split(".")[1]: o.split("=")[1] for o in SUITES[args.suite][0] if "batch_size" in o}
    print(f"{model}, seq_len {args.seq_len}, global batch {batch['global_batch_size']} in micro-batches of "
          f"{batch['micro_batch_size']}, fp32;")  # fmt: skip
    print(f"medians of {args.repeats} alternated runs of {args.steps} steps (steps > {WARMUP})")
    with tempfile.TemporaryDirectory() as tmp:
        for world, cases in worlds.items():
            results = {name: [] for name in cases}
            for repeat in range(args.repeats):
                for i, (name, case) in enumerate(cases.items()):
                    results[name].append(_run(tmp, world, case, os.path.join(tmp, f"w{world}_{i}_{repeat}"), args))
            _report(world, results)


def _report(world: int, results: dict[str, list[dict]]) -> None:
    print(f"{world} ranks: {'case':24} {'step s':>8} {'peak GiB':>9} {'last loss':>10}")
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    for name, m in median.items():
        print(f"{'':9}{name:24} {m['step_s']:8.3f} {m['peak_gib']:9.3f} {m['loss']:10.4f}")
    base_name, *others = median
    base = median[base_name]
    for name in others:
        m = median[name]
        step, peak = m["step_s"] / base["step_s"], m["peak_gib"] / base["peak_gib"]
        print(f"{world} ranks: {name} / {base_name}: step time x{step:.2f}, peak x{peak:.2f}")


if __name__ == "__main__":
    main()
