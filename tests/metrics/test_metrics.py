"""Throughput windows and peak memory per window, on the real classes: a clock that only the test moves (so the
window's arithmetic is exact), and real allocations read back from the kernel's own peak (VmHWM)."""

import numpy as np
import pytest
import torch

from fsdp_research.metrics import meters as metrics
from fsdp_research.metrics.meters import PeakMemory, Throughput


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_saves_and_eval_are_left_out_of_the_window(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    throughput = Throughput(1024, 8, 2, 1e6, 100.0, torch.device("cpu"))
    throughput.start()
    for step in range(4):
        clock.now += 0.5  # a step
        if step in (1, 3):
            with throughput.paused():
                clock.now += 7.0  # a save or an eval
    out = throughput.stop(4)
    assert out["step_time_s"] == pytest.approx(0.5)
    assert out["tokens_per_s"] == pytest.approx(2048.0)
    assert out["samples_per_s_per_device"] == pytest.approx(8.0)
    assert out["mfu"] == pytest.approx(2048.0 * 1e6 / (100e12 * 2))
    throughput.start()  # the next window starts afresh
    clock.now += 1.0
    assert throughput.stop(1)["step_time_s"] == pytest.approx(1.0)


def test_peak_memory_is_per_window_and_the_run_keeps_the_largest():
    peak = PeakMemory(torch.device("cpu"))
    initial = peak.run["peak_rss_gib"]  # this process's since it started
    peak.reset()
    big = np.ones(512 * 2**20 // 8)  # 512 MiB, touched
    first = peak.window()["peak_rss_gib"]
    del big
    peak.reset()
    second = peak.window()["peak_rss_gib"]
    assert first - second > 0.4, (first, second)
    assert peak.run["peak_rss_gib"] == max(initial, first)
