"""The command line's shape, common to every subcommand: flags and Hydra overrides in any order, and the old
`python -m fsdp_research.<module>` paths still running their command after a note."""

import argparse
import runpy
import subprocess
import sys

import pytest
from torch.multiprocessing import ProcessExitedException

from fsdp_research.cli import COMMANDS, main
from fsdp_research.cli import doctor as doctor_cli
from fsdp_research.cli import submit as submit_cli
from tests.conftest import ROOT
from tests.helpers.cli import subprocess_env

# Old module path -> the command it runs now.
MOVED = {
    "doctor": "doctor",
    "plan": "plan",
    "report": "report",
    "export": "export",
    "scaling": "scaling",
    "slurm_submit": "submit",
}


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


def _note(old: str) -> str:
    command = MOVED[old]
    return f"note: python -m fsdp_research.{old} is now fsdp-research {command} (python -m fsdp_research {command})"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_runs_its_command(old, monkeypatch, capsys):
    """In this process, as `python -m` runs a module (runpy), with the command's exit code; the module is first
    dropped from sys.modules, as in a fresh process (runpy warns when it is already imported)."""
    monkeypatch.delitem(sys.modules, f"fsdp_research.{old}", raising=False)
    monkeypatch.setattr(sys, "argv", ["python", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(f"fsdp_research.{old}", run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [_note(old)]
    assert out.startswith(f"usage: fsdp-research {MOVED[old]} ")


def test_old_module_path_in_a_process_of_its_own():
    """The real `python -m`, once: doctor.py runs as __main__ and is imported again by the command it runs."""
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_research.doctor", "model=llama_tiny", "world_size=2"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert _note("doctor") in result.stderr.splitlines()
    assert result.stdout.startswith("no findings: ")
