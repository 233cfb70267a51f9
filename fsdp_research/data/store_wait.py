"""Waiting for a token store's build on the file system (fsdp_research.data.store_builder builds it): the parts'
completion markers and recorded errors in the build dir, its builders' heartbeats, and the wait itself (a poll of the
build dir's time stamp, never a collective), with its progress reports."""

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsdp_research.data.store import part_name
from fsdp_research.errors import ConfigError, DataError

POLL_S = 0.2
# report(parts done, parts, seconds), called now and then while a store is built.
Report = Callable[[int, int, float], None]


def error_record(err: BaseException, build: str) -> dict[str, Any]:
    if isinstance(err, ConfigError):
        return {"build": build, "kind": "config", "key": err.key, "problem": err.problem, "fix": err.fix}
    return {"build": build, "kind": "data", "message": str(err)}


def raise_recorded(record: dict[str, Any]) -> None:
    if record["kind"] == "config":
        raise ConfigError(record["key"], record["problem"], record["fix"])
    raise DataError(record["message"])


def part_done(build_dir: str, index: int) -> dict | None:
    try:
        with open(os.path.join(build_dir, f"{part_name(index)}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def done_count(build_dir: str) -> int:
    """Complete parts in the build dir (one directory listing, however many parts)."""
    return sum(name.startswith("part_") and name.endswith(".json") for name in os.listdir(build_dir))


def recorded_error(build_dir: str, build: str) -> None:
    """Raise the first error a part of this build recorded (markers of earlier builds are ignored)."""
    for name in sorted(os.listdir(build_dir)) if os.path.isdir(build_dir) else []:
        if name.endswith(".error"):
            try:
                with open(os.path.join(build_dir, name)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if record.get("build") == build:
                raise_recorded(record)


class Progress:
    """report(parts done, parts, seconds) now and then while a store is built."""

    def __init__(self, total_parts: int, report: Report | None, every_s: float):
        self.total, self.report, self.every_s = total_parts, report, every_s
        self.started = self._last = time.monotonic()

    def update(self, build_dir: str) -> None:
        now = time.monotonic()
        if self.report is not None and now - self._last >= self.every_s:
            self._last = now
            self.report(done_count(build_dir), self.total, now - self.started)


# However the build dir's time stamp behaves (coarse on some file systems), the waiters look in full this often.
LOOK_S = 5.0


@contextlib.contextmanager
def heartbeat(build_dir: str, build: str, rank: int, every_s: float) -> Iterator[None]:
    """While this rank builds: a file of its own touched every every_s, which tells the waiters it is alive however
    long a part takes (not while it waits: a rank waiting for a dead one must not keep the build alive)."""
    path = os.path.join(build_dir, f"alive-{build}-{rank}")
    stop = threading.Event()

    def beat() -> None:
        while True:
            with contextlib.suppress(OSError), open(path, "a"):
                os.utime(path)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=beat, name="token-store-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def alive(build_dir: str, build: str, within_s: float) -> bool:
    """Whether a builder of this build has touched its heartbeat in the last within_s seconds."""
    try:
        names = [name for name in os.listdir(build_dir) if name.startswith(f"alive-{build}-")]
    except FileNotFoundError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            if time.time() - os.stat(os.path.join(build_dir, name)).st_mtime < within_s:
                return True
    return False


def wait(build_dir: str, build: str, timeout_s: float, progress: Progress, finished: Callable[[], bool]) -> None:
    """Until finished(), which is asked when the build dir changes: one stat a poll (a part's marker, an error's
    and the publishing rename all change it), not a listing of the parts. An error a builder recorded is raised;
    no change for timeout_s with no builder's heartbeat in that time (a builder killed before it could record an
    error) fails on every waiter. A part may take longer than timeout_s: its builder's heartbeat goes on."""
    seen, changed, looked = None, time.monotonic(), 0.0
    while True:
        try:
            stamp = os.stat(build_dir).st_mtime_ns
        except FileNotFoundError:  # renamed: published
            stamp = None
        now = time.monotonic()
        if stamp != seen or now - looked >= LOOK_S:
            if stamp != seen:
                seen, changed = stamp, now
            looked = now
            recorded_error(build_dir, build)
            if finished():
                return
        if now - changed > timeout_s:
            if alive(build_dir, build, timeout_s):
                changed = now
            else:
                raise DataError(
                    f"token store build {build_dir}: no part finished, no error recorded and no builder alive for "
                    f"{timeout_s:g} s (distributed.timeout_s): a builder died without a word; start the job again "
                    "(finished parts are kept)"
                )
        progress.update(build_dir)
        time.sleep(POLL_S)
