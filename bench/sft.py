"""Fine-tuning figures, whole runs side by side (`python train.py ...`, alternated, each run's medians over its
steps after the first few): on chats of examples/fine_tune/make_data.py (short conversations), packed windows
(data.packing=true, the default) against one conversation per window, in tokens/s (every position) and target
tokens/s (the positions that train); and LoRA (model.lora.r) against a full fine-tune: step time and peak memory
(the process's peak RSS on the CPU, the device's peak on a GPU).

    .venv/bin/python bench/sft.py [--steps 30] [--repeats 2] [--hidden 512] [--layers 8] [--seq-len 512] [overrides ...]
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

WARMUP = 4

CASES = {
    "packed, full": [],
    "one per window, full": ["data.packing=false"],
    "packed, LoRA r=16": ["model.lora.r=16", "model.lora.alpha=32"],
}


def _run(tmp: str, name: str, repeat: int, args, extra: list[str]) -> dict:
    run_dir = os.path.join(tmp, f"case{list(CASES).index(name)}_{repeat}")
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), "model=pretrained", f"model.name_or_path={tmp}/model",
        "data=chat", f"data.paths=[{tmp}/train.jsonl]", f"data.seq_len={args.seq_len}", "logger=none",
        "trainer.log_interval=1", "trainer.eval_interval=0", f"trainer.max_steps={args.steps}",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "checkpoint.interval=0",
        "checkpoint.export=false", f"hydra.run.dir={run_dir}", *extra, *args.overrides,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)
    records = read_records(run_dir)
    steps = [r for r in records if "loss" in r and r["step"] > WARMUP]
    summary = next(r["summary"] for r in records if "summary" in r)
    step_s = statistics.median(r["step_time_s"] for r in steps)
    positions = 8 * args.seq_len
    targets = statistics.median(r["targets"] for r in steps)
    peak = summary.get("peak_device_gib") or summary.get("peak_rss_gib")
    return {"step_s": step_s, "tokens_s": positions / step_s, "targets_s": targets / step_s,
            "target_share": targets / positions, "peak_gib": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "examples", "fine_tune", "make_data.py"), tmp,
             "--hidden", str(args.hidden), "--layers", str(args.layers)],
            check=True, capture_output=True,
        )  # fmt: skip
        results: dict[str, list[dict]] = {name: [] for name in CASES}
        for repeat in range(args.repeats):
            for name, extra in CASES.items():
                results[name].append(_run(tmp, name, repeat, args, extra))
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    print(f"llama hidden {args.hidden} x {args.layers} layers, seq_len {args.seq_len}, 8 windows a step, "
          f"medians of {args.repeats} alternated runs of {args.steps} steps (steps > {WARMUP})")  # fmt: skip
    print(f"{'case':<22}{'step s':>9}{'tokens/s':>11}{'targets/s':>11}{'target share':>14}{'peak GiB':>10}")
    for name, m in med.items():
        print(f"{name:<22}{m['step_s']:>9.3f}{m['tokens_s']:>11,.0f}{m['targets_s']:>11,.0f}"
              f"{m['target_share']:>14.1%}{m['peak_gib']:>10.3f}")  # fmt: skip
    full, unpacked, lora = (med[n] for n in CASES)
    print(f"packed / one per window: target tokens/s x{full['targets_s'] / unpacked['targets_s']:.2f}")
    time_ratio, peak_ratio = lora["step_s"] / full["step_s"], lora["peak_gib"] / full["peak_gib"]
    print(f"LoRA / full: step time x{time_ratio:.2f}, peak memory x{peak_ratio:.2f}")


if __name__ == "__main__":
    main()
