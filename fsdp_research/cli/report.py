"""fsdp-research report <sweep dir | run dir> [--out <png>]: one row per job of a Hydra multirun sweep or SLURM
array (the overrides that differ between jobs, final loss and eval loss, throughput per device, peak memory, steps,
status), for an Optuna search its trials (state, objective, searched values) and best trial, and a PNG of the loss
curves, throughput and peak memory, and a search's objective per trial and per searched key (default
<dir>/report.png). A single run's dir: its row, and its loss, eval loss, lr, throughput and memory by step."""

import argparse
import os

from fsdp_research.cli.common import fail
from fsdp_research.jobs.report import (
    differing_overrides,
    format_table,
    format_trials,
    load_job,
    load_trials,
    plot,
    plot_run,
)
from fsdp_research.jobs.sweep import job_dirs
from fsdp_research.metrics.sinks import METRICS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research report", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("sweep_dir", help="outputs/multirun/<date>/<time>, or a run's outputs/runs/<date>/<time>")
    parser.add_argument("--out", help="PNG path (default: <dir>/report.png)")
    args = parser.parse_intermixed_args(argv)
    if not os.path.isdir(args.sweep_dir):
        return fail(f"no such sweep or run directory: {args.sweep_dir}")
    out = args.out or os.path.join(args.sweep_dir, "report.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if os.path.exists(os.path.join(args.sweep_dir, METRICS)):  # one run
        job = {**load_job(args.sweep_dir), "label": "-"}
        print(format_table([job]))
        plot_run(job, out)
        print(f"wrote {out}")
        return 0
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
    plot(jobs, out, search)
    print(f"wrote {out}")
    return 0
