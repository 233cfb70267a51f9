"""Where log lines and metrics go: a line on stdout (a progress bar on a terminal), metrics.jsonl in the run
dir, and W&B. Only rank 0 logs metrics; the other ranks get sinks that drop everything. Also the reader of
metrics.jsonl, for everything that reads a run back."""

import json
import logging
import os
import sys
import time
from typing import Any

from fsdp_research.config.schema import LoggerConfig

log = logging.getLogger("fsdp_research")

METRICS = "metrics.jsonl"


def setup_logging(run_dir: str, rank: int) -> None:
    """Rank 0 logs INFO to stdout and <run dir>/train.log; other ranks only warnings, to stderr. Every line
    carries its rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    fmt = logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0:
        handlers.append(logging.FileHandler(os.path.join(run_dir, "train.log")))
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if "tokens_per_s" in key or "samples_per_s" in key:
            return f"{key} {value:,.0f}"
        return f"{key} {value:.4g}"
    return f"{key} {value}"


class Console:
    """One concise line per logged step; on a terminal, a progress bar with ETA."""

    KEYS = ("loss", "reward", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu")

    def __init__(self, max_steps: int, tty: bool | None = None):
        self.max_steps = max_steps
        self.tty = sys.stdout.isatty() if tty is None else tty
        self._t0 = time.perf_counter()
        self._first_step: int | None = None

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        text = " | ".join(_fmt(k, metrics[k]) for k in self.KEYS if k in metrics)
        if not text:  # a callback's record: metrics.jsonl and W&B have it
            return
        if not self.tty:
            log.info(f"step {step}/{self.max_steps} | {text}")
            return
        if self._first_step is None:
            self._first_step, self._t0 = step, time.perf_counter()
        done = step - self._first_step
        eta = (time.perf_counter() - self._t0) / done * (self.max_steps - step) if done else 0.0
        bar = "#" * int(30 * step / self.max_steps)
        end = "\n" if step >= self.max_steps else ""
        sys.stdout.write(f"\r[{bar:<30}] {step}/{self.max_steps} ETA {eta:4.0f}s | {text}{end}")
        sys.stdout.flush()

    def samples(self, step: int, rows: list[dict[str, str]]) -> None:
        for row in rows:
            log.info(f"step {step}/{self.max_steps} | sample {row['prompt']!r} -> {row['completion']!r}")


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """Every record of <run dir>/metrics.jsonl: the per-step metrics and the one-off records ({"step", "doctor"},
    {"step", "profile"}, {"step", "summary"}); a line cut short (a run killed mid-write) is skipped."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning(f"{path} line {number} is cut short (a run killed while writing it): skipped")
    return records


def step_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The per-step metric rows of a run (one-off records have no loss)."""
    return [row for row in read_records(run_dir) if "loss" in row]


class JsonlSink:
    """One JSON object per logged step. A resumed run first drops the lines after its checkpoint's step, so
    the file never holds a step twice."""

    def __init__(self, run_dir: str, resume_step: int):
        path = os.path.join(run_dir, METRICS)
        # What the file keeps, and whether it held steps after resume_step (that this run trains again).
        self.kept: list[dict[str, Any]] = []
        self.rewound = False
        if os.path.exists(path):
            records = read_records(run_dir)
            self.kept = [record for record in records if record["step"] <= resume_step]
            self.rewound = len(self.kept) < len(records)
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(record) + "\n" for record in self.kept)
            os.replace(path + ".tmp", path)
        self.file = open(path, "a", buffering=1)

    def log(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics) + "\n")

    def note(self, step: int, key: str, value: Any) -> None:
        self.log({"step": step, key: value})

    def samples(self, step: int, rows: list[dict[str, str]]) -> None:
        self.note(step, "samples", rows)

    def finish(self, failed: bool = False) -> None:
        self.file.close()


WANDB_RUN = "wandb_run.json"


class WandbSink:
    """The run's W&B run (id: the checkpoint's, so a resume continues it). A resume from a step older than what W&B
    holds (it keeps the first row of a step and drops later ones, so the steps trained again would be lost and the
    dead attempt's kept) goes to a new W&B run instead, forked: same name and group, config `forked_from`
    "<id>@<step>", and metrics.jsonl's records up to that step logged into it first. Its history is then
    metrics.jsonl's, in any mode (W&B's own rewind, resume_from, is a server-side beta that offline runs lack).
    <run dir>/wandb_run.json says which W&B run the run dir logged to last and up to which step, so that a run that
    forked and died before its next checkpoint is known (the checkpoint still names the run it forked from)."""

    def __init__(
        self, cfg: LoggerConfig, run_dir: str, config: dict[str, Any], run_id: str, fork: JsonlSink | None = None
    ):
        import wandb

        self._record = os.path.join(run_dir, WANDB_RUN)
        if fork is not None:
            step = max((record["step"] for record in fork.kept), default=0)
            config = {**config, "forked_from": f"{run_id}@{step}"}
            run_id = new_run_id()
        self.run = wandb.init(
            project=cfg.project,
            group=cfg.group,
            name=cfg.name,
            tags=list(cfg.tags),
            config=config,
            dir=run_dir,
            mode=cfg.mode,
            id=run_id,
            resume="allow",
        )
        self.run_id = run_id
        for record in fork.kept if fork is not None else []:
            # Per-step rows hold numbers; notes (findings, the summary, a profile) went to the summary.
            if all(v is None or isinstance(v, (int, float)) for v in record.values()):
                self.log(record)
            else:
                for key, value in record.items():
                    if key == "samples":  # the completions' record; a step row's "samples" is a count
                        self.samples(record["step"], value)
                    elif key != "step":
                        self.note(record["step"], key, value)

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        with open(self._record + ".tmp", "w") as f:
            json.dump({"id": self.run_id, "step": metrics["step"]}, f)
        os.replace(self._record + ".tmp", self._record)

    def note(self, step: int, key: str, value: Any) -> None:
        # The summary, not the history: one record per run, and the history stays one row per logged step.
        self.run.summary[key] = value

    def samples(self, step: int, rows: list[dict[str, str]]) -> None:
        import wandb

        table = wandb.Table(
            columns=["step", "prompt", "completion"], data=[[step, r["prompt"], r["completion"]] for r in rows]
        )
        self.run.log({"completions": table}, step=step)  # "samples" is the count of samples trained on

    def finish(self, failed: bool = False) -> None:
        # A run that raised is marked failed in W&B, not left running.
        self.run.finish(exit_code=1 if failed else 0)


class Sinks:
    """Fans metrics out to every sink; empty on ranks other than 0."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (a new one where a resume forked it), None without W&B."""
        return next((sink.run_id for sink in self.sinks if isinstance(sink, WandbSink)), None)

    def log(self, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(metrics)

    def samples(self, step: int, rows: list[dict[str, str]]) -> None:
        """Samples (trainer.sample_prompts' continuations, an objective's completions): console lines, a metrics.jsonl
        record, a W&B table."""
        if not rows:
            return
        for sink in self.sinks:
            if hasattr(sink, "samples"):
                sink.samples(step, rows)

    def note(self, step: int, key: str, value: Any) -> None:
        """A one-off record (the doctor's findings, a profile): a metrics.jsonl line {"step": step, key: value}
        and the W&B summary. Not the console: the caller says it in words."""
        for sink in self.sinks:
            if hasattr(sink, "note"):
                sink.note(step, key, value)

    def finish(self, failed: bool = False) -> None:
        """Closes every sink, once (also when training raised: a failed sweep job leaves no W&B run open)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            if hasattr(sink, "finish"):
                sink.finish(failed)


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(4)


def build_sinks(
    cfg: LoggerConfig, run_dir: str, rank: int, max_steps: int, config: dict[str, Any], run_id: str, resume_step: int
) -> Sinks:
    if rank != 0:
        return Sinks([])
    jsonl = JsonlSink(run_dir, resume_step)
    sinks: list = [Console(max_steps), jsonl]
    if cfg.kind == "wandb":
        try:  # the W&B run this run dir logged to last, and its last step
            with open(os.path.join(run_dir, WANDB_RUN)) as f:
                last = json.load(f)
        except (OSError, ValueError):
            last = {"id": run_id, "step": 0}
        rewound = jsonl.rewound or last["step"] > resume_step
        sinks.append(WandbSink(cfg, run_dir, config, last["id"], fork=jsonl if rewound else None))
    return Sinks(sinks)
