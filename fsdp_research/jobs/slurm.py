"""SLURM: a file of override lines as one job array (one job per line, written as on the command line; blank
lines and # comments are skipped; task i of slurm/array.sbatch runs line i in outputs/slurm/<array job id>/<i>/
under the current dir), and the checks that run before anything is submitted, shared with the Hydra launcher
path (fsdp_research.jobs.sweep). `fsdp-research submit` is the command."""

import os
import shlex
import shutil
import subprocess
from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from fsdp_research.errors import SubmitError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARRAY_SCRIPT = os.path.join(REPO, "slurm", "array.sbatch")


def _reason(err: OverrideParseException) -> str:
    # Hydra's message: "Error parsing override ...", the reason, then a "See https://..." line.
    lines = [
        line
        for line in str(err).splitlines()
        if line.strip() and not line.startswith(("Error parsing override", "See https://"))
    ]
    return "; ".join(lines) or str(err)


def read_override_lines(path: str) -> list[list[str]]:
    """The overrides of each job (one per non-blank, non-comment line), each parsed as Hydra would."""
    parser = OverridesParser.create()
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise SubmitError(f"cannot read {path}: {err.strerror}") from None
    jobs = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            overrides = shlex.split(line)
        except ValueError as err:  # an unclosed quote
            raise SubmitError(f"{path} line {number}: {err}") from None
        for override in overrides:
            try:
                parsed = parser.parse_overrides([override])[0]
            except OverrideParseException as err:
                raise SubmitError(f"{path} line {number}: bad override {override!r}: {_reason(err)}") from None
            if parsed.is_sweep_override():
                raise SubmitError(f"{path} line {number}: {override!r} is a sweep; write one job per line")
        jobs.append(overrides)
    if not jobs:
        raise SubmitError(f"{path} has no override lines (only blank lines and comments): a sweep of zero jobs")
    return jobs


def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch is not on PATH: submit from a machine of the SLURM cluster")


def check_partition(name: str) -> None:
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SubmitError(f"cannot list the SLURM partitions (sinfo): {err}") from None
    if result.returncode != 0:
        raise SubmitError(f"cannot list the SLURM partitions (sinfo): {result.stderr.strip()}")
    known = [p.rstrip("*") for p in result.stdout.split()]  # the default partition is marked "name*"
    if name not in known:
        raise SubmitError(f"unknown SLURM partition {name!r}; this cluster has: {', '.join(known) or 'none'}")


def submit(jobs: list[list[str]], parallel: int, partition: str | None, sbatch_args: Sequence[str]) -> str:
    """Submits the array after the SLURM checks; returns its job id."""
    check_sbatch()
    if partition:
        check_partition(partition)
    command = ["sbatch", "--parsable", f"--array=0-{len(jobs) - 1}%{parallel}"]
    command += [f"--partition={partition}"] if partition else []
    # One argument per job: array.sbatch splits its own line back into words.
    command += [*sbatch_args, ARRAY_SCRIPT, *(shlex.join(job) for job in jobs)]
    # The batch script finds train.py here, wherever the array is submitted from.
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "FSDP_RESEARCH_ROOT": REPO})
    if result.returncode != 0:
        raise SubmitError(f"sbatch failed: {' '.join(result.stderr.split())}")
    return result.stdout.strip().split(";")[0]  # --parsable prints "<id>" or "<id>;<cluster>"
