"""The scaling benchmark's verdict, and its CLI end to end (real processes, a few steps)."""

import json
import subprocess
import sys

import pytest

from fsdp_research.tools.scaling import verdict
from tests.conftest import FAST, ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_verdict_abandons_a_sharding_slower_than_ddp():
    lines = verdict({"per_linear": {1: 10.0, 2: 12.0}, "ddp": {1: 11.0, 2: 20.0}}, "per_linear")
    assert "scaling efficiency 60%" in lines[1]  # 12 / (2 x 10)
    assert lines[-1].startswith("verdict: per_linear gives 12.00 samples/s on 2 devices, below ddp's 20.00")
    assert "abandon" in lines[-1]


def test_verdict_keeps_a_sharding_that_keeps_up():
    lines = verdict({"blockwise": {1: 10.0, 2: 19.0}, "ddp": {1: 11.0, 2: 18.0}}, "blockwise")
    assert lines[-1].startswith("verdict: blockwise keeps up with ddp")


def test_cli_writes_json_and_png(tmp_path):
    overrides = [o for o in FAST if not o.startswith("trainer.log_interval")]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_research",
            "scaling",
            *overrides,
            "--world-sizes",
            "1",
            "--steps",
            "7",
            "--micro-batch",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "scaling.json").read_text())
    assert set(report["samples_per_s"]) == {"blockwise", "ddp"}
    assert all(v["1"] > 0 for v in report["samples_per_s"].values())
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
