"""Sweep report: every job dir of a sweep (<sweep dir>/<n>/) as one row: the overrides that differ between
jobs, final loss and eval loss, throughput per device, peak memory, steps and status; and a PNG with the loss
curves and each job's throughput and peak memory. A single run's: its row and its curves (loss and eval loss, lr,
throughput, memory by step). `fsdp-research report` is the command."""

import os
import statistics
from typing import Any

from omegaconf import OmegaConf

from fsdp_research.jobs.sweep import MULTIRUN, job_overrides
from fsdp_research.metrics.sinks import read_records
from fsdp_research.train.rundir import outcome

# CUDA runs log allocated and reserved peaks, CPU runs the RSS. Reserved comes first: it is what the caching
# allocator actually holds on the device, so it is the number that decides whether a config fits.
MEMORY_KEYS = ("peak_mem_reserved_gib", "peak_mem_allocated_gib", "peak_rss_gib")

# (header, job dict key, format) for each column of the table.
COLUMNS = (
    ("job", "num", "{}"),
    ("overrides", "label", "{}"),
    ("loss", "final_loss", "{:.4f}"),
    ("eval_loss", "final_eval_loss", "{:.4f}"),
    ("tok/s/dev", "tokens_per_s_per_device", "{:,.0f}"),
    ("samples/s/dev", "samples_per_s_per_device", "{:,.1f}"),
    ("peak_mem_GiB", "peak_mem_gib", "{:.2f}"),
    ("steps", "steps", "{}"),
    ("status", "status", "{}"),
)


# Where hydra/sweeper=optuna keeps its study (composition.OPTUNA_SWEEPER's storage).
STUDY = "optuna.db"


def load_trials(sweep_dir: str) -> dict[str, Any] | None:
    """An Optuna search's trials, read from the study in the sweep dir through Optuna: {"objective", "direction",
    "params" (the searched keys), "trials": [{"number", "state", "value", "params"}], "best": the best trial or
    None}; None for a sweep that is not a search."""
    path = os.path.join(sweep_dir, STUDY)
    if not os.path.exists(path):
        return None
    import optuna

    storage = f"sqlite:///{os.path.abspath(path)}"
    multirun = OmegaConf.load(os.path.join(sweep_dir, MULTIRUN))
    names = [summary.study_name for summary in optuna.get_all_study_summaries(storage=storage)]
    # The sweep's own study (by its multirun.yaml), or the file's only one.
    name = multirun.hydra.sweeper.get("study_name") if len(names) > 1 else names[0]
    study = optuna.load_study(study_name=name, storage=storage)
    trials = [
        {"number": t.number, "state": t.state.name.lower(), "value": t.value, "params": dict(t.params)}
        for t in sorted(study.trials, key=lambda t: t.number)
    ]
    complete = [t for t in trials if t["state"] == "complete"]
    return {
        # An older sweep's multirun.yaml names it trainer.objective.
        "objective": str(multirun.trainer.get("objective") or multirun.trainer.get("sweep_metric")),
        "direction": study.direction.name.lower(),
        "params": sorted({key for t in trials for key in t["params"]}),
        "trials": trials,
        "best": next(t for t in complete if t["number"] == study.best_trial.number) if complete else None,
    }


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def format_trials(search: dict[str, Any]) -> str:
    """The trial table (number, state, objective, each searched key) and the best trial, as plain text."""
    header = ["trial", "state", search["objective"], *search["params"]]
    cells = [header] + [
        [
            str(t["number"]),
            t["state"],
            _cell(t["value"]),
            *(_cell(t["params"].get(key)) for key in search["params"]),
        ]
        for t in search["trials"]
    ]
    table = _aligned(cells)
    best = search["best"]
    if best is None:
        return table + "\nbest trial: none completed"
    params = " ".join(f"{k}={v}" for k, v in best["params"].items())
    return (
        table
        + f"\nbest trial: {best['number']} ({search['direction']} {search['objective']}: {best['value']:.6g}) {params}"
    )


def _median_after_warmup(rows: list[dict[str, Any]], key: str) -> float | None:
    """The first logged interval includes warmup (allocator, kernel selection), so it is left out when others
    exist."""
    values = [row[key] for row in rows if key in row]
    values = values[1:] or values
    return statistics.median(values) if values else None


def summarize(rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The table's numbers from a job's per-step metric rows and eval records (None where it logged nothing)."""
    eval_losses = [row["eval_loss"] for row in evals]
    memory_key = next((key for key in MEMORY_KEYS if any(key in row for row in rows)), None)
    return {
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_eval_loss": eval_losses[-1] if eval_losses else None,
        "tokens_per_s_per_device": _median_after_warmup(rows, "tokens_per_s_per_device"),
        "samples_per_s_per_device": _median_after_warmup(rows, "samples_per_s_per_device"),
        "peak_mem_gib": max(row[memory_key] for row in rows if memory_key in row) if memory_key else None,
        "steps": rows[-1]["step"] if rows else None,
    }


def load_job(job_dir: str) -> dict[str, Any]:
    """One job dir: its number, overrides, metrics rows, summary and status; missing files give empty values."""
    status = outcome(job_dir)
    records = read_records(job_dir)
    rows, evals = [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]
    # Without status.json the job may still be running or may have died without a word: we cannot tell.
    name = os.path.basename(os.path.normpath(job_dir))
    return {
        "num": int(name) if name.isdigit() else 0,
        "overrides": job_overrides(job_dir),
        "rows": rows,
        "evals": evals,
        "status": status.get("status", "unknown"),
        "error": status.get("error"),
        **summarize(rows, evals),
    }


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def differing_overrides(jobs: list[dict[str, Any]]) -> list[list[str]]:
    """Per job, its overrides whose key does not have the same value in every job (a key some jobs lack
    differs). A single job keeps all of its overrides."""
    if len(jobs) == 1:
        return [list(jobs[0]["overrides"])]
    per_job = [dict(_split(o) for o in job["overrides"]) for job in jobs]
    keys = {key for overrides in per_job for key in overrides}
    varying = {key for key in keys if len({overrides.get(key) for overrides in per_job}) > 1}
    return [[o for o in job["overrides"] if _split(o)[0] in varying] for job in jobs]


def format_table(jobs: list[dict[str, Any]]) -> str:
    """A plain-text table of COLUMNS, one line per job, left-aligned, '-' where a value is missing."""
    cells = [[header for header, _, _ in COLUMNS]]
    cells += [["-" if job.get(key) is None else fmt.format(job[key]) for _, key, fmt in COLUMNS] for job in jobs]
    return _aligned(cells)


def _aligned(cells: list[list[str]]) -> str:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in cells)


def _plot_search(fig, cell, search: dict[str, Any]) -> None:
    """A search's row: the objective of each complete trial against its number, then against each searched key
    (a log axis where the key's values span more than a decade), failed trials marked on the trial axis."""
    keys = search["params"]
    axes = cell.subgridspec(1, 1 + len(keys)).subplots(sharey=True)
    axes = list(axes) if keys else [axes]
    done = [t for t in search["trials"] if t["value"] is not None]
    values = [t["value"] for t in done]
    axes[0].plot([t["number"] for t in done], values, "o-", color="tab:blue")
    failed = [t["number"] for t in search["trials"] if t["state"] == "fail"]
    for number in failed:
        axes[0].axvline(number, color="tab:red", alpha=0.3)
    axes[0].set(xlabel="trial (red: failed)", ylabel=search["objective"], title=f"{search['objective']} per trial")
    for ax, key in zip(axes[1:], keys):
        points = [(t["params"][key], t["value"]) for t in done if isinstance(t["params"].get(key), (int, float))]
        ax.plot([x for x, _ in points], [y for _, y in points], "o", color="tab:blue")
        xs = [x for x, _ in points]
        if xs and min(xs) > 0 and max(xs) > 10 * min(xs):
            ax.set_xscale("log")
        ax.set(xlabel=key)
    for ax in axes:
        ax.grid(alpha=0.3)


def plot(jobs: list[dict[str, Any]], path: str, search: dict[str, Any] | None = None) -> None:
    """Loss curves (eval loss as markers), then tokens/s per device and peak memory as horizontal bars (long
    override labels stay readable), one colour per job throughout; for a search, a row of its objective against
    the trial and each searched key."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes and CI
    import matplotlib.pyplot as plt

    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(jobs))]
    names = [f"{job['num']}: {job['label']}" for job in jobs]
    rows = [3, 1, 1] + ([2] if search else [])
    fig = plt.figure(figsize=(10, 5 + 1.2 * len(jobs) + (3 if search else 0)))
    grid = fig.add_gridspec(len(rows), 1, height_ratios=rows)
    ax_loss, ax_tps, ax_mem = (fig.add_subplot(grid[i]) for i in range(3))
    if search:
        _plot_search(fig, grid[3], search)
    for job, name, color in zip(jobs, names, colors):
        rows = job["rows"]
        if rows:
            ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=name)
        evals = job["evals"]
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color=color, mfc="none")
    if any(job["evals"] for job in jobs):
        ax_loss.plot([], [], "o", color="gray", mfc="none", label="eval loss")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize="small")
    for ax, key, title, fmt in (
        (ax_tps, "tokens_per_s_per_device", "tokens/s per device (median)", "{:,.0f}"),
        (ax_mem, "peak_mem_gib", "peak memory (GiB)", "{:.2f}"),
    ):
        values = [job[key] or 0.0 for job in jobs]
        ax.barh(range(len(jobs)), values, color=colors)
        ax.set_yticks(range(len(jobs)), names, fontsize="small")
        ax.invert_yaxis()  # job 0 on top, as in the table
        for i, job in enumerate(jobs):
            ax.annotate(
                "no data" if job[key] is None else fmt.format(job[key]),
                (values[i], i),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize="small",
            )
        ax.set_title(title)
        ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_run(job: dict[str, Any], path: str) -> None:
    """One run's curves by step: loss (eval loss as markers), learning rate, tokens/s per device, peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, evals = job["rows"], job["evals"]
    memory_key = next((key for key in MEMORY_KEYS if any(key in row for row in rows)), None)
    panels = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s_per_device", "tokens/s per device"))
    panels += ((memory_key, f"peak memory (GiB, {memory_key})"),) if memory_key else ()
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for ax, (key, title) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), label=key)
        if key == "loss" and evals:
            ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", mfc="none", label="eval loss")
            ax.legend(fontsize="small")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
