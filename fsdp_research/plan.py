"""`python -m fsdp_research.plan`: the old path of `fsdp-research plan`, kept for a while."""

if __name__ == "__main__":
    from fsdp_research.cli import run_moved

    run_moved("fsdp_research.plan", "plan")
