"""A tokenization worker process, started by fsdp_research.data.store_builder with the build dir, the tokenizer and the
build's name as arguments: it builds each part it is sent (a JSON line [index, part] on stdin) and answers each with
a line on stdout, until stdin closes; a part it cannot build is recorded in the build dir and ends it with exit
code 2. It imports no torch: a worker starts in a fraction of a second."""

import json
import os
import sys
import threading
import time

from fsdp_research.data.parts import Part
from fsdp_research.data.store_builder import build_parts
from fsdp_research.errors import ConfigError, DataError


def _exit_with_parent(parent: int) -> None:
    """A worker whose rank was killed stops too, instead of writing on alone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    build_dir, tokenizer, build = sys.argv[1:4]
    try:
        for line in sys.stdin:
            index, part = json.loads(line)
            job = [(index, Part(**{**part, "files": tuple(part["files"])}))]
            for done in build_parts(job, build_dir, tokenizer, build):
                print(json.dumps(done), flush=True)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
