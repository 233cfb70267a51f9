"""`python -m fsdp_research <command> ...`: the command-line tools (fsdp_research.cli)."""

import sys

from fsdp_research.cli import main

sys.exit(main())
