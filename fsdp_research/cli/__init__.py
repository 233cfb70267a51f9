"""The command-line tools, one subcommand each: `fsdp-research <command> ...` (or `python -m fsdp_research
<command> ...`). Training itself is train.py. Each command module has main(argv) -> exit code and parses with
parse_intermixed_args: its flags and the Hydra overrides go in any order."""

import importlib
import sys
from typing import NoReturn

from fsdp_research.distributed.forkserver import run_and_exit

COMMANDS = {
    "plan": "memory and communication per rank of a config, without allocating the model",
    "doctor": "check a config against the causes of slow FSDP (--measure: from a short profiled run)",
    "export": "convert a resume checkpoint into a Hugging Face directory, offline",
    "generate": "continue prompts with a run's export (merged, or the base with its LoRA adapter)",
    "report": "one row per job of a sweep, and a PNG of its curves",
    "scaling": "samples/s at 1..N devices for a sharding and for DDP, and the abandon verdict",
    "simulate": "one rank of an N-rank job on the fake process group: each set-up phase's time and memory",
    "submit": "submit a file of override lines as one SLURM job array",
    "tokenize": "build the token stores of a data config ahead of training",
}


def run() -> NoReturn:
    """The command line's entry (`fsdp-research`, `python -m fsdp_research`): main() in a process of its own."""
    run_and_exit(main)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(f"{__name__}.{argv[0]}").main(argv[1:]) or 0
    if argv and argv[0] not in ("-h", "--help"):
        print(f"error: unknown command {argv[0]!r}; fix: use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())
    print(f"usage: fsdp-research <command> [args...]\n\ncommands:\n{listing}")
    return 0 if argv else 2
