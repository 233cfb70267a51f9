"""fsdp-research submit <override file> [--parallel P] [--partition NAME] [-- <sbatch options>]: one SLURM job
array, one task per line of overrides (blank lines and # comments skipped); task i runs line i in
outputs/slurm/<array job id>/<i>/. Every line and the partition are checked before anything is submitted."""

import argparse
import sys
from collections.abc import Sequence

from fsdp_research.cli.common import fail
from fsdp_research.errors import SubmitError
from fsdp_research.jobs.slurm import read_override_lines, submit


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    argv, sbatch_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="fsdp-research submit", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("override_file", help="one job per line: overrides as on the command line")
    parser.add_argument("--parallel", type=int, default=16, help="array tasks running at once (default 16)")
    parser.add_argument("--partition", help="default: the cluster's default partition")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.parallel < 1:
            raise SubmitError(f"--parallel must be 1 or more, not {args.parallel}")
        jobs = read_override_lines(args.override_file)
        job_id = submit(jobs, args.parallel, args.partition, sbatch_args)
    except SubmitError as err:
        return fail(err, "; nothing submitted")
    print(
        f"submitted array job {job_id}: {len(jobs)} task(s), run dirs outputs/slurm/{job_id}/<task>/ "
        f"(watch: squeue -j {job_id}; sacct -j {job_id}; fsdp-research report outputs/slurm/{job_id})"
    )
    return 0
