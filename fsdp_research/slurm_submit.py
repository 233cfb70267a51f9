"""`python -m fsdp_research.slurm_submit`: the old path of `fsdp-research submit`, kept for a while."""

if __name__ == "__main__":
    from fsdp_research.cli import run_moved

    run_moved("fsdp_research.slurm_submit", "submit")
