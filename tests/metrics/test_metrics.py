"""Throughput windows and peak memory per window, on the real classes: a clock that only the test moves (so the
window's arithmetic is exact), packed samples' tokens (their padding left out), and real allocations read back from
the kernel's own peak (VmHWM)."""

import numpy as np
import pytest
import torch

from fsdp_research.data.packing import fill
from fsdp_research.data.pipeline import build_data
from fsdp_research.jobs.compose import compose
from fsdp_research.metrics import meters as metrics
from fsdp_research.metrics.meters import PeakMemory, Throughput, packed_tokens
from tests.helpers.chats import chat_llama, write_chats
from tests.helpers.zoo import pretrained


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_saves_and_eval_are_left_out_of_the_window(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    monkeypatch.setattr(metrics.time, "time", clock)
    throughput = Throughput(1024, 8, 2, 1e6, 100.0, torch.device("cpu"))
    throughput.start()
    for step in range(4):
        clock.now += 0.5  # a step
        if step in (1, 3):
            with throughput.paused():
                clock.now += 7.0  # a save or an eval
    out = throughput.stop(4)
    assert out["time"] == clock.now  # the record's wall clock is the window's close: its steps lie before it
    assert out["step_time_s"] == pytest.approx(0.5)
    assert out["tokens_per_s"] == pytest.approx(2048.0)
    assert out["samples_per_s_per_device"] == pytest.approx(8.0)
    assert out["mfu"] == pytest.approx(2048.0 * 1e6 / (100e12 * 2))
    throughput.start()  # the next window starts afresh
    clock.now += 1.0
    assert throughput.stop(1)["step_time_s"] == pytest.approx(1.0)


def test_packed_steps_count_their_tokens_not_their_positions(monkeypatch):
    """Packed samples: tokens/s (and the MFU of them) from the tokens each step added, samples/s as before."""
    clock = Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    throughput = Throughput(1024, 8, 2, 1e6, 100.0, torch.device("cpu"))
    throughput.start()
    for tokens in (700, 900):
        clock.now += 0.5
        throughput.add(torch.tensor(tokens))
    out = throughput.stop(2)
    assert out["tokens_per_s"] == pytest.approx(1600.0)
    assert out["samples_per_s"] == pytest.approx(16.0)
    assert out["mfu"] == pytest.approx(1600.0 * 1e6 / (100e12 * 2))
    throughput.start()  # a window of its own: nothing added, every position a token
    clock.now += 1.0
    assert throughput.stop(1)["tokens_per_s"] == pytest.approx(1024.0)


@pytest.mark.parametrize("masking", [True, False])
def test_packed_tokens_leave_the_padding_out(masking):
    """Windows of 3 + 4 tokens, of one 10-token document, of 2 tokens (fsdp_research.data.packing.fill). With document
    masking a document may end in the pad token (as a conversation ends in eos, the pad where there is none); without,
    the pad token tells the padding."""
    pad = 9 if masking else 0

    def doc(*ids: int):
        return np.array(ids), np.ones(len(ids), bool)

    windows = [[doc(5, 6, 9), doc(7, 8, 3, 9)], [doc(*range(1, 10), 9)], [doc(4, 9)]]
    rows = np.empty((3, 3, 10), np.int64)
    for row, docs in zip(rows, windows):
        fill(row, docs, pad, masking)
    assert packed_tokens(torch.from_numpy(rows), None if masking else pad) == 7 + 10 + 2


@pytest.mark.parametrize("overrides", [[], ["data.packing=false"], ["data.document_masking=false"]])
def test_packed_tokens_are_the_conversations_positions(tmp_path, overrides):
    """Packed conversations (their store's windows): their tokens are the positions their documents fill."""
    chats = *pretrained(chat_llama(str(tmp_path / "model"))), f"data.paths=[{write_chats(str(tmp_path / 'c.jsonl'))}]"
    data = build_data(compose([*chats, "data=chat", *overrides]).data, 0, 0)
    [windows] = data.stream.windows
    samples = torch.from_numpy(windows.read(np.arange(windows.count)))
    assert packed_tokens(samples, data.pad_id) == windows.lengths[windows.docs].sum()


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
