"""fsdp-research report <sweep dir> [--out <png>]: one row per job of a Hydra multirun sweep or SLURM array (the
overrides that differ between jobs, final loss and eval loss, throughput per device, peak memory, steps,
status), for an Optuna search its trials (state, objective, searched values) and best trial, and a PNG of the loss
curves, throughput and peak memory, and a search's objective per trial and per searched key (default
<sweep dir>/report.png)."""

import argparse
import os

from ..report import differing_overrides, format_table, format_trials, load_job, load_trials, plot
from ..sweep import job_dirs
from .common import fail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research report", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("sweep_dir", help="outputs/multirun/<date>/<time>")
    parser.add_argument("--out", help="PNG path (default: <sweep dir>/report.png)")
    args = parser.parse_intermixed_args(argv)
    if not os.path.isdir(args.sweep_dir):
        return fail(f"no such sweep directory: {args.sweep_dir}")
    jobs = [load_job(d) for d in job_dirs(args.sweep_dir)]
    if not jobs:
        return fail(f"no job directories (<n>/) in {args.sweep_dir}")
    for job, overrides in zip(jobs, differing_overrides(jobs)):
        job["label"] = " ".join(overrides) or "-"
    print(format_table(jobs))
    for job in jobs:
        if job["error"]:
            print(f"job {job['num']} {job['status']}: {job['error']}")
    try:
        search = load_trials(args.sweep_dir)
    except ImportError:  # a search's dir read where the [sweep] extra is not installed
        search = None
        print("its Optuna study (optuna.db) is not listed: pip install -e '.[sweep]'")
    if search:
        print(format_trials(search))
    out = args.out or os.path.join(args.sweep_dir, "report.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    plot(jobs, out, search)
    print(f"wrote {out}")
    return 0
