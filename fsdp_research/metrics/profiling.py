"""Where a step's time goes (trainer.profile_steps): torch.profiler over a few steps after one warm-up step, a
Chrome trace per rank in <run dir>/profile/trace_rank<r>.json, and rank 0's per-step breakdown computed from
its trace: data wait, forward, backward, optimizer, communication, and exposed communication.

Communication is the collectives themselves: c10d calls and the backend's own spans (gloo's worker threads,
NCCL kernels on GPU). Exposed communication is the part of it during which no compute runs: on GPU, NCCL
kernel time outside every other kernel, so it shows whether the next block's all-gather hides behind this
block's compute; on CPU, time gloo works while the training thread runs no aten op. gloo collectives mostly
block the training thread, so on CPU exposed communication is close to all of it."""

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

log = logging.getLogger("fsdp_research")

LABELS = ("data", "forward", "backward", "optimizer")
# Lower-case name fragments of communication events (record_param_comms wraps every c10d call).
COMM = ("c10d::", "gloo:", "nccl", "record_param_comms")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

Interval = tuple[float, float]


def region(label: str) -> record_function:
    """Marks one phase of a step in the trace; nearly free when no profiler runs."""
    return record_function(f"step.{label}")


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(trace_events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step means in seconds over the profiled steps of a Chrome trace (torch.profiler's export); empty
    when the trace holds no complete step."""
    spans = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    if not steps:
        return {}
    train_threads = {e["tid"] for e in steps}
    on_gpu = any(e.get("cat") == "kernel" for e in spans)

    def is_comm(e: dict[str, Any]) -> bool:
        return any(marker in e["name"].lower() for marker in COMM)

    def merged(keep) -> list[Interval]:
        return _union([(e["ts"], e["ts"] + e["dur"]) for e in spans if keep(e)])

    if on_gpu:
        comm = merged(lambda e: e.get("cat") == "kernel" and is_comm(e))
        compute = merged(lambda e: e.get("cat") in DEVICE_CATS and not is_comm(e))
    else:
        comm = merged(lambda e: e.get("cat") in ("cpu_op", "user_annotation") and is_comm(e))
        compute = merged(
            lambda e: (
                e.get("cat") == "cpu_op"
                and e["tid"] in train_threads
                and e["name"].startswith("aten::")
                and not is_comm(e)
            )
        )
    n = len(steps)
    out: dict[str, Any] = {"steps": n, "step_time_s": sum(e["dur"] for e in steps) / n / 1e6}
    for label in LABELS:
        name = f"step.{label}"
        # On GPU the device-side span of a phase is its real duration: the CPU only launches the kernels.
        device = merged(lambda e: e.get("cat") == "gpu_user_annotation" and e["name"] == name) if on_gpu else []
        host = merged(lambda e: e.get("cat") == "user_annotation" and e["name"] == name)
        out[f"{label}_s"] = _length(device or host) / n / 1e6
    out["comm_s"] = _length(comm) / n / 1e6
    out["exposed_comm_s"] = (_length(comm) - _overlap(comm, compute)) / n / 1e6
    out["exposed_comm_share"] = out["exposed_comm_s"] / out["step_time_s"]
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


def format_breakdown(result: dict[str, Any]) -> str:
    ms = {k: result[k] * 1e3 for k in ("step_time_s", "comm_s", "exposed_comm_s", *(f"{x}_s" for x in LABELS))}
    return (
        f"step {ms['step_time_s']:.1f} ms: data {ms['data_s']:.1f} | forward {ms['forward_s']:.1f} | "
        f"backward {ms['backward_s']:.1f} | optimizer {ms['optimizer_s']:.1f}; communication "
        f"{ms['comm_s']:.1f} ms, exposed {ms['exposed_comm_s']:.1f} ms "
        f"({result['exposed_comm_share']:.0%} of the step) [mean of {result['steps']} steps]"
    )


class StepProfiler:
    """Profiles `steps` training steps after one warm-up step, on every rank (so that no rank's profiling
    overhead makes the others wait); a no-op with steps=0. Call step(done) after each training step and
    close() after the loop: when the window ends, rank 0 logs the breakdown and writes it to the sinks
    as {"step": done, "profile": {...}}."""

    def __init__(self, steps: int, run_dir: str, rank: int, device: torch.device, sinks):
        self.path = os.path.join(run_dir, "profile", f"trace_rank{rank}.json")
        self.rank, self.sinks = rank, sinks
        self._traced = False
        self._done = 0
        self._profiler: profile | None = None
        if steps > 0:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self._profiler = profile(
                activities=activities,
                on_trace_ready=self._write,
                schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            )
            self._profiler.start()

    def _write(self, prof: profile) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        self._traced = True

    def step(self, done: int) -> None:
        if self._profiler is not None:
            if self._done == 0:
                # The warm-up step ends at different times on different ranks (first optimizer step, lazy
                # inits): line them up, so the first profiled step does not count that as waiting.
                dist.barrier()
            self._done = done
            self._profiler.step()
            if self._traced:
                self.close()

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        """A built-in callback of the trainer's: the step boundary, before any eval or save of the step."""
        self.step(step)

    def close(self) -> None:
        """Stops the profiler; a window cut short by the end of training reports the steps it has."""
        if self._profiler is None:
            return
        self._profiler.stop()
        self._profiler = None
        if self.rank != 0 or not self._traced:
            return
        with open(self.path) as f:
            result = breakdown(json.load(f)["traceEvents"])
        if result:
            log.info(f"profile: {format_breakdown(result)}; trace {self.path}")
            self.sinks.note(self._done, "profile", result)
        else:  # the trace is there all the same: say where
            log.info(f"profile: no complete profiled step to break down; trace {self.path}")
