"""The sweep report CLI on a fake multirun dir: table text, PNG, and the error exit."""

import json

import pytest
import yaml

from tests.helpers.cli import Finished, command

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _report(*args: str) -> Finished:
    return command(["report", *args], timeout=60)


def _job(sweep, num, overrides, status, error=None, metrics=()):
    job_dir = sweep / str(num)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job_dir / "status.json").write_text(json.dumps({"status": status, "error": error, "overrides": overrides}))
    if metrics:
        (job_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in metrics))


def _metrics(tokens_per_s, peak, first_tokens_per_s=1.0):
    """Four logged steps; the first (warmup) has a throughput the report must ignore."""
    rows = []
    for i, step in enumerate((5, 10, 15, 20)):
        tps = first_tokens_per_s if i == 0 else tokens_per_s + 10 * (i - 2)  # median of the rest = tokens_per_s
        rows.append(
            {
                "step": step,
                "loss": 5.0 - 0.5 * i,
                "lr": 1e-3,
                "tokens_per_s_per_device": tps,
                "samples_per_s_per_device": tps / 128,
                "peak_rss_gib": peak + 0.01 * i,
            }
        )
    rows[1]["eval_loss"], rows[3]["eval_loss"] = 4.9, 3.75
    return rows


def test_report_table_and_png(tmp_path):
    sweep = tmp_path / "multirun" / "2026-01-01" / "12-00-00-000000"
    common = ["model=llama_tiny", "trainer.max_steps=20"]
    _job(sweep, 0, common + ["sharding=blockwise", "precision=fp32"], "completed", metrics=_metrics(12345.0, 0.5))
    _job(sweep, 1, common + ["sharding=ddp", "precision=fp32"], "completed", metrics=_metrics(23456.0, 0.75))
    _job(sweep, 2, common + ["sharding=ddp", "precision=bf16"], "failed", error="RuntimeError: boom")
    (sweep / ".submitit").mkdir()  # not a job dir: ignored

    result = _report(str(sweep))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header, job0, job1, job2 = lines[:4]
    assert header.split() == [
        "job",
        "overrides",
        "loss",
        "eval_loss",
        "tok/s/dev",
        "samples/s/dev",
        "peak_mem_GiB",
        "steps",
        "status",
    ]
    assert "model=" not in result.stdout and "trainer.max_steps" not in result.stdout
    assert job0.split() == [
        "0",
        "sharding=blockwise",
        "precision=fp32",
        "3.5000",
        "3.7500",
        "12,345",
        "96.4",
        "0.53",
        "20",
        "completed",
    ]
    assert job1.split()[:6] == ["1", "sharding=ddp", "precision=fp32", "3.5000", "3.7500", "23,456"]
    assert job2.split() == ["2", "sharding=ddp", "precision=bf16", "-", "-", "-", "-", "-", "-", "failed"]
    assert "job 2 failed: RuntimeError: boom" in result.stdout

    png = sweep / "report.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_report_single_job_shows_all_overrides_and_out(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, ["sharding=ddp", "precision=fp32"], "completed", metrics=_metrics(1000.0, 0.5)[:1])
    out = tmp_path / "plots" / "r.png"
    result = _report(str(sweep), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[:3] == ["0", "sharding=ddp", "precision=fp32"]
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_report_errors(tmp_path):
    for missing in (tmp_path / "nope", tmp_path):
        result = _report(str(missing))
        assert result.returncode == 2
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
