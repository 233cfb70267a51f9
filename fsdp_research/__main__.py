"""`python -m fsdp_research <command> ...`: the command-line tools (fsdp_research.cli)."""

from fsdp_research.cli import run

run()
