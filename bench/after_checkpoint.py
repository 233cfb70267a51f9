"""Tokens/s after a checkpoint against before, in the default job (1 process: llama_tiny, bf16, 16 x 128 tokens):
the run saves half way; beside it, alternated, the same run without saves. Medians of the 10-step windows before
the save (after a warm-up) and after it.

    .venv/bin/python bench/after_checkpoint.py [--steps 120] [--repeats 2] [overrides ...]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_research.metrics.sinks import step_metrics  # noqa: E402


def _ratio(steps: int, interval: int, overrides: list[str], out: str) -> float:
    """Median tokens/s of the windows after step steps/2 over those before it."""
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "logger=none", "trainer.eval_interval=0",
         "checkpoint.export=false", f"trainer.max_steps={steps}", f"checkpoint.interval={interval}",
         f"hydra.run.dir={out}", *overrides],
        check=True, capture_output=True,
    )  # fmt: skip
    rates = {m["step"]: m["tokens_per_s"] for m in step_metrics(out)}
    half = steps // 2
    before = [r for s, r in rates.items() if 20 < s <= half]
    after = [r for s, r in rates.items() if s > half + 10]
    return statistics.median(after) / statistics.median(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ratios = {"a save half way": [], "no saves": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, interval in (("a save half way", args.steps // 2), ("no saves", 0)):
                ratios[name].append(_ratio(args.steps, interval, args.overrides, os.path.join(tmp, f"{interval}_{r}")))
    print(f"default job, 1 process, {args.steps} steps x {args.repeats} alternated repeats; tokens/s after / before")
    for name, values in ratios.items():
        print(f"  {name:>16}: {statistics.median(values):.2f}x (per repeat: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
