"""A real full disk: a small tmpfs mounted for the length of a block (the test is skipped where mounting is not
allowed)."""

import contextlib
import gc
import os
import subprocess

import pytest


@contextlib.contextmanager
def small_disk(path: str, mib: int):
    os.makedirs(path, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", path], check=True, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {getattr(err, 'stderr', '') or err}")
    try:
        yield path
    finally:
        # What the block opened there may be held by a reference cycle (a caught exception's traceback holds the
        # frames that hold a store's files) until the collector runs: "target is busy", once in a CI run.
        gc.collect()
        subprocess.run(["umount", path], check=True)
