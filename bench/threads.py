"""CPU threads per rank, measured: the default job (its first 20 steps, logged every step) under each thread setting,
on this machine idle and beside another job of 2 busy threads (a matmul loop, as a second run on the node would be),
settings alternated so that drift hits each alike. Prints the median step time (steps 4-20, best of the repeats) per
setting and load, and each against the best idle setting; `default` is what the app picks with no variable set
(each rank its share of the cores, GOMP_SPINCOUNT=3000 from train.py).

    .venv/bin/python bench/threads.py [--repeats 3] [--steps 20]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment added to the run's; a variable the caller has set is removed first.
SETTINGS = {
    "default": {},
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads, libgomp's spin (300k)": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "300000"},
    "2 threads, passive wait": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "2 threads, spin 3k": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "3000"},
}
LOAD = "import torch; torch.set_num_threads(2); a = torch.randn(768, 768)\nwhile True: a @ a"


def _step_time(env: dict[str, str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = ["logger=none", f"trainer.max_steps={steps}", "trainer.log_interval=1", "trainer.eval_interval=0"]
        overrides += ["checkpoint.interval=0", "checkpoint.export=false", f"hydra.run.dir={run_dir}"]
        subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, check=True, capture_output=True)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "step_time_s" in r and r["step"] >= 4]
    return statistics.median(r["step_time_s"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    times: dict[tuple[str, str], float] = {}
    for load in ("idle", "loaded"):
        burner = subprocess.Popen([sys.executable, "-c", LOAD]) if load == "loaded" else None
        try:
            for _ in range(args.repeats):
                for name, extra in SETTINGS.items():
                    t = _step_time({**base, **extra}, args.steps)
                    times[load, name] = min(times.get((load, name), t), t)
        finally:
            if burner is not None:
                burner.kill()
    best = min(times["idle", name] for name in SETTINGS)
    print(f"{'setting':<34} {'idle s/step':>12} {'x best':>7} {'loaded s/step':>14} {'x best idle':>12}")
    for name in SETTINGS:
        idle, loaded = times["idle", name], times["loaded", name]
        print(f"{name:<34} {idle:>12.4f} {idle / best:>7.2f} {loaded:>14.4f} {loaded / best:>12.2f}")


if __name__ == "__main__":
    main()
