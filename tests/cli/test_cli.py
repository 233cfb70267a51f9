"""The command line's shape, common to every subcommand: flags and Hydra overrides in any order, one-line errors."""

import argparse
import subprocess
import sys

import pytest
from torch.multiprocessing import ProcessExitedException

from fsdp_research.cli import COMMANDS, main
from fsdp_research.cli import doctor as doctor_cli
from fsdp_research.cli import submit as submit_cli
from tests.conftest import ROOT
from tests.helpers.cli import subprocess_env

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_parses_flags_among_overrides(command, monkeypatch, capsys):
    """argparse's parse_args refuses `a=1 --flag b=2` (the overrides end at the flag): every command must use
    parse_intermixed_args instead, which never calls parse_args."""

    def refused(*args, **kwargs):
        raise AssertionError(f"fsdp-research {command} parses with parse_args, not parse_intermixed_args")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", refused)
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: fsdp-research {command} ")


def test_plan_flag_between_overrides(capsys):
    assert main(["plan", "model=llama_tiny", "--device", "cpu", "trainer.micro_batch_size=4", "world_size=2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama_tiny: ") and "on 2 rank(s)" in out and "micro-batch 4 x" in out


def test_doctor_measure_between_overrides(monkeypatch):
    """--measure reaches the short run with both overrides around it; the run is replaced by one that fails at
    once, whose exit code doctor returns."""
    seen = {}

    def failed_run(overrides, world_size, steps, run_dir):
        seen.update(overrides=list(overrides), world_size=world_size)
        raise ProcessExitedException("rank 0 failed", 0, 0, 3)

    monkeypatch.setattr(doctor_cli, "measure", failed_run)
    assert main(["doctor", "model=llama_tiny", "--measure", "sharding=root_only", "world_size=2"]) == 3
    assert seen == {"overrides": ["model=llama_tiny", "sharding=root_only"], "world_size": 2}


def test_submit_flags_around_the_file_and_sbatch_options_after_the_separator(tmp_path, monkeypatch, capsys):
    lines = tmp_path / "jobs.txt"
    lines.write_text("model=llama_tiny trainer.max_steps=5\n")
    calls = []
    monkeypatch.setattr(submit_cli, "submit", lambda *args: calls.append(args) or "123")
    argv = ["submit", "--parallel", "2", str(lines), "--partition", "debug", "--", "--time=1:00", "-A", "proj"]
    assert main(argv) == 0
    assert calls == [([["model=llama_tiny", "trainer.max_steps=5"]], 2, "debug", ["--time=1:00", "-A", "proj"])]
    assert capsys.readouterr().out.startswith("submitted array job 123: 1 task(s)")


@pytest.mark.parametrize(
    "argv, error",
    [
        (["report", "{missing}", "--out", "{tmp}/report.png"], "error: no such sweep or run directory: {missing}"),
        (["export", "{missing}", "--dtype", "bfloat16", "{tmp}/hf"], "error: {missing}: "),
    ],
    ids=["report", "export"],
)
def test_missing_input_after_flags_is_one_line(argv, error, tmp_path, capsys):
    paths = {"missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    assert main([arg.format(**paths) for arg in argv]) == 2
    assert capsys.readouterr().err.startswith(error.format(**paths))


@pytest.mark.slow  # an interpreter of its own (~10 s)
def test_the_package_runs_a_command_in_a_process_of_its_own():
    """The real `python -m fsdp_research <command>`, once."""
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_research", "doctor", "model=llama_tiny", "world_size=2"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no findings: ")
