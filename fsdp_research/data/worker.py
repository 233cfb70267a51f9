"""A tokenization worker process (started by fsdp_research.data.store for a rank's share of a store's parts):
reads its job as JSON on stdin, builds each part; a part it cannot build is recorded in the build dir and ends it
with exit code 2. It imports no torch: a worker starts in a fraction of a second."""

import json
import os
import sys
import threading
import time

from ..errors import ConfigError, DataError
from .parts import Part
from .store import build_parts


def _exit_with_parent(parent: int) -> None:
    """A worker whose rank was killed stops too, instead of writing on alone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    job = json.load(sys.stdin)
    parts = [(index, Part(**{**part, "files": tuple(part["files"])})) for index, part in job["parts"]]
    try:
        for _ in build_parts(parts, job["dir"], job["tokenizer"], job["build"]):
            pass
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
