"""Submit a file of override lines as one SLURM job array:

    python -m fsdp_research.slurm_submit <override file> [--parallel P] [--partition NAME] [-- <sbatch options>]

One job per line, written as on the command line (blank lines and # comments are skipped). Task i of
slurm/array.sbatch runs line i in outputs/slurm/<array job id>/<i>/ under the current dir. Every check runs
before sbatch, so bad input submits nothing. The SLURM checks are shared with the Hydra launcher path
(fsdp_research.sweep)."""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARRAY_SCRIPT = os.path.join(REPO, "slurm", "array.sbatch")


class SubmitError(Exception):
    """Why nothing was submitted, in one line."""


def _reason(err: OverrideParseException) -> str:
    # Hydra's message: "Error parsing override ...", the reason, then a "See https://..." line.
    lines = [line for line in str(err).splitlines()
             if line.strip() and not line.startswith(("Error parsing override", "See https://"))]
    return "; ".join(lines) or str(err)


def read_override_lines(path: str) -> List[List[str]]:
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


def submit(jobs: List[List[str]], parallel: int, partition: Optional[str], sbatch_args: Sequence[str]) -> str:
    """Submits the array after the SLURM checks; returns its job id."""
    check_sbatch()
    if partition:
        check_partition(partition)
    command = ["sbatch", "--parsable", f"--array=0-{len(jobs) - 1}%{parallel}"]
    command += [f"--partition={partition}"] if partition else []
    # One argument per job: array.sbatch splits its own line back into words.
    command += [*sbatch_args, ARRAY_SCRIPT, *(shlex.join(job) for job in jobs)]
    # The batch script finds train.py here, wherever the array is submitted from.
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, "FSDP_RESEARCH_ROOT": REPO})
    if result.returncode != 0:
        raise SubmitError(f"sbatch failed: {' '.join(result.stderr.split())}")
    return result.stdout.strip().split(";")[0]  # --parsable prints "<id>" or "<id>;<cluster>"


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, sbatch_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m fsdp_research.slurm_submit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("override_file", help="one job per line: overrides as on the command line")
    parser.add_argument("--parallel", type=int, default=16, help="array tasks running at once (default 16)")
    parser.add_argument("--partition", help="default: the cluster's default partition")
    args = parser.parse_args(argv)
    try:
        if args.parallel < 1:
            raise SubmitError(f"--parallel must be 1 or more, not {args.parallel}")
        jobs = read_override_lines(args.override_file)
        job_id = submit(jobs, args.parallel, args.partition, sbatch_args)
    except SubmitError as err:
        print(f"error: {err}; nothing submitted", file=sys.stderr)
        sys.exit(2)
    print(f"submitted array job {job_id}: {len(jobs)} task(s), run dirs outputs/slurm/{job_id}/<task>/ "
          f"(watch: squeue -j {job_id}; sacct -j {job_id}; python -m fsdp_research.report outputs/slurm/{job_id})")


if __name__ == "__main__":
    main()
