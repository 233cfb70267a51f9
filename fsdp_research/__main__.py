"""`python -m fsdp_research <command> ...`: the command-line tools (fsdp_research.cli)."""

import sys

from .cli import main

sys.exit(main())
