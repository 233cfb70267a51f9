"""Building token stores (fsdp_research.data.store says what one is): every rank of a job builds parts, each with
this rank's share of the node's cores, in worker processes: its own (r, r + world, ...), then any other's not yet
taken (each claimed once); rank 0 publishes. Ranks wait for parts and for the manifest on the file system, never
inside a collective, so an hour of tokenization cannot time a job out. A part that fails leaves an error marker
that the waiting ranks raise too; a builder that dies without one fails them after distributed.timeout_s (the
waiting: fsdp_research.data.store_wait)."""

import contextlib
import json
import logging
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from fsdp_research.data.parts import Part, batches, read_part, text_bytes
from fsdp_research.data.store import KEY, MANIFEST, VERSION, StoreSpec, TokenStore, part_name, verify
from fsdp_research.data.store_wait import (
    POLL_S,
    Progress,
    Report,
    done_count,
    error_record,
    heartbeat,
    part_done,
    recorded_error,
    wait,
)
from fsdp_research.data.tokenizer import load_tokenizer
from fsdp_research.errors import ConfigError, DataError

log = logging.getLogger("fsdp_research")

PartBuild = Callable[[Part, int, str], dict[str, Any]]
# About a second of one core's work: the text a worker process is worth starting for.
WORKER_BYTES = {"byte": 100 * 2**20, "other": 4 * 2**20}


def write_atomic(path: str, write: Callable[[Any], None], mode: str = "w") -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_part(part: Part, index: int, build_dir: str, tokenizer_name: str) -> dict[str, int]:
    """Tokenize one part into build_dir: its tokens, its document index, then its completion marker."""
    tok = load_tokenizer(tokenizer_name)
    prefix = os.path.join(build_dir, part_name(index))
    ends: list[np.ndarray] = []
    counts = {"tokens": 0, "documents": 0, "text_bytes": 0}

    def write_tokens(f) -> None:
        for texts in batches(read_part(part)):
            tokens, lengths = tok.encode(texts)
            f.write(tokens.tobytes())
            ends.append(counts["tokens"] + np.cumsum(lengths))
            counts["tokens"] += len(tokens)
            counts["documents"] += len(texts)
            counts["text_bytes"] += text_bytes(texts)

    write_atomic(prefix + ".tokens", write_tokens, "wb")
    return finish_part(prefix, np.concatenate([np.zeros(0, np.int64), *ends]), counts, (".tokens",))


def finish_part(prefix: str, ends: np.ndarray, counts: dict[str, int], written: Sequence[str]) -> dict[str, int]:
    """A part's document index (where each document ends), then its completion marker, which lists its files (those
    with the suffixes `written` and the index) and sizes."""
    write_atomic(prefix + ".docs.npy", lambda f: np.save(f, ends), "wb")
    files = {os.path.basename(prefix) + s: os.path.getsize(prefix + s) for s in (*written, ".docs.npy")}
    write_atomic(prefix + ".json", lambda f: json.dump({**counts, "files": files}, f))
    return counts


def build_parts(
    jobs: Iterable[tuple[int, Part]], build_dir: str, tokenizer_name: str, build: str, make: PartBuild | None = None
) -> Iterator[dict]:
    """Build each (index, part) (text, or by `make`), yielding {"index", "tokens", "documents", "text_bytes"} as
    each is done; a part that fails leaves an error marker for the ranks that wait on it, and raises."""
    for index, part in jobs:
        try:
            counts = make(part, index, build_dir) if make else build_part(part, index, build_dir, tokenizer_name)
            yield {"index": index, **counts}
        except (ConfigError, OSError) as err:
            error = err
            if isinstance(err, OSError):
                free = shutil.disk_usage(build_dir).free / 2**20
                error = DataError(
                    f"writing token store part {index} in {build_dir} failed ({type(err).__name__}: {err}; "
                    f"{free:.1f} MiB free there); no store was published, earlier stores are intact"
                )
            marker = os.path.join(build_dir, f"{part_name(index)}.error")
            try:
                write_atomic(marker, lambda f: json.dump(error_record(error, build), f))
            except OSError:
                pass  # a full disk may refuse even this: the launcher stops the waiting ranks when this one exits
            raise error from None


def _worker_count(jobs: Sequence[tuple[int, Part]], tokenizer_name: str, workers: int) -> int:
    """Worker processes worth starting: each costs about a second, so only for about a second of work each."""
    per_worker = WORKER_BYTES["byte" if tokenizer_name == "byte" else "other"]
    text = sum(os.path.getsize(f) for _, part in jobs for f in part.files if os.path.isfile(f))
    return max(1, min(workers, len(jobs), -(-text // per_worker)))


def _claimed(build_dir: str, build: str, rank: int, world: int, parts: Sequence[Part]) -> Iterator[tuple[int, Part]]:
    """The parts this rank builds: its own (r, r + world, ...), then any other rank's not yet taken, from the end
    (work stealing: a rank with slow or large parts leaves them to those done first). Each is taken by creating its
    claim in a directory of this build's, so that a part is built once per build."""
    claims = os.path.join(build_dir, f"claims-{build}")
    try:
        os.mkdir(claims)  # not makedirs: a build dir already published (renamed) must not come back
    except FileExistsError:
        pass
    except FileNotFoundError:
        return
    order = [i for i in range(len(parts)) if i % world == rank] + [
        i for i in reversed(range(len(parts))) if i % world != rank
    ]
    for i in order:
        if part_done(build_dir, i) is not None:
            continue
        try:
            os.close(os.open(os.path.join(claims, part_name(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except (FileExistsError, FileNotFoundError):  # taken, or the store is published and its build dir gone
            continue
        yield i, parts[i]


def _run_workers(
    jobs: Iterator[tuple[int, Part]],
    estimate: Sequence[tuple[int, Part]],
    build_dir: str,
    spec: StoreSpec,
    build: str,
    workers: int,
    tick: Callable[[], None],
) -> None:
    """The parts jobs yields on `workers` processes (in this one when one is enough; as many as the parts of
    `estimate` are worth), each taking the next part when it is done with one; tick() now and then."""
    workers = 1 if spec.build else _worker_count(estimate, spec.tokenizer, workers)
    if workers == 1:
        for _ in build_parts(jobs, build_dir, spec.tokenizer, build, spec.build):
            tick()
        return
    # One thread each: the processes are the parallelism.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "fsdp_research.data.worker", build_dir, spec.tokenizer, build]
    procs = [
        subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(workers)
    ]

    def feed(proc) -> None:
        """The next part to this worker, or the end of its work."""
        job = next(jobs, None)
        if job is not None:
            index, part = job
            proc.stdin.write(json.dumps([index, asdict(part)]) + "\n")
            proc.stdin.flush()
        else:
            proc.stdin.close()

    try:
        with selectors.DefaultSelector() as selector:
            for proc in procs:
                feed(proc)
                selector.register(proc.stdout, selectors.EVENT_READ, proc)
            while selector.get_map():
                for key, _ in selector.select(POLL_S):
                    if key.data.stdout.readline():  # a part done
                        feed(key.data)
                    else:  # the worker has ended
                        selector.unregister(key.fileobj)
                tick()
        if any(proc.wait() for proc in procs):
            recorded_error(build_dir, build)
            codes = sorted({proc.returncode for proc in procs})
            raise DataError(f"a tokenization worker failed (exit codes {codes}; its error is on stderr)")
    finally:
        for proc in procs:
            proc.kill()


def _published(path: str, spec: StoreSpec) -> bool:
    """Whether another job's rank 0, building in the same build dir, published the store (renamed the dir) first."""
    return verify(path, spec.fingerprint) is None


def _publish(build_dir: str, path: str, spec: StoreSpec) -> None:
    done = [part_done(build_dir, i) for i in range(len(spec.parts))]
    if None in done:  # the build dir was renamed since this rank 0 saw every part done
        if _published(path, spec):
            return
        raise DataError(f"token store build {build_dir}: a finished part's marker is gone; start the job again")
    files = {name: size for d in done for name, size in d["files"].items()}
    tok = load_tokenizer(spec.tokenizer)
    manifest = {
        "version": VERSION,
        "fingerprint": spec.fingerprint,
        "dtype": tok.dtype.name,
        "eos_id": tok.eos_id,
        "vocab_size": tok.vocab_size,
        "tokens": sum(d["tokens"] for d in done),
        "documents": sum(d["documents"] for d in done),
        "text_bytes": sum(d["text_bytes"] for d in done),
        "parts": [{"tokens": d["tokens"], "documents": d["documents"]} for d in done],
        "files": files,
    }
    try:
        # The key (every source file's path, size and time) beside the manifest, which every start reads.
        write_atomic(os.path.join(build_dir, KEY), lambda f: f.write(spec.key))
        write_atomic(os.path.join(build_dir, MANIFEST), lambda f: json.dump(manifest, f, indent=1))
        for name in os.listdir(build_dir):  # the builds' claims and heartbeats
            if name.startswith(("claims-", "alive-")):
                shutil.rmtree(os.path.join(build_dir, name), ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(build_dir, name))
        if os.path.exists(path):
            if _published(path, spec):  # just now, by another job, whose ranks read it
                return
            shutil.rmtree(path)  # a broken store of this fingerprint: replaced
        os.rename(build_dir, path)
    except OSError as err:
        if _published(path, spec):
            return
        raise DataError(f"publishing token store {path} failed ({type(err).__name__}: {err})") from None


def ensure_store(
    spec: StoreSpec,
    root: str,
    rank: int = 0,
    world: int = 1,
    workers: int = 1,
    build: str = "local",
    report: Report | None = None,
    every_s: float = 10.0,
    timeout_s: float = 600.0,
) -> TokenStore:
    """The store of spec under root: opened when it exists and verifies, else built by every rank of the job
    (rank r takes parts r, r + world, ...) and published by rank 0. `build` names this build (the same on every
    rank of the job); report(parts done, parts, seconds) is called every every_s seconds while it is built; a
    build that shows no progress for timeout_s fails on every rank."""
    path = os.path.join(root, spec.fingerprint)
    if os.path.isdir(path):
        problem = verify(path, spec.fingerprint)
        if problem is None:
            return TokenStore(path)
        if rank == 0:
            log.warning(f"token store {path}: {problem}; rebuilding it")
    build_dir = os.path.join(root, f".build-{spec.fingerprint}")
    progress = Progress(len(spec.parts), report, every_s)
    try:
        os.makedirs(build_dir, exist_ok=True)
        if verify(path, spec.fingerprint) is None:
            # Another job published it (renamed the build dir) after this one looked and before the makedirs above
            # made the build dir anew: open that store, never build one to replace it under its readers.
            with contextlib.suppress(OSError):
                os.rmdir(build_dir)
            return TokenStore(path)
        mine = [(i, p) for i, p in enumerate(spec.parts) if i % world == rank and part_done(build_dir, i) is None]
        jobs = _claimed(build_dir, build, rank, world, spec.parts)
        with heartbeat(build_dir, build, rank, min(5.0, timeout_s / 4)):
            _run_workers(jobs, mine, build_dir, spec, build, workers, lambda: progress.update(build_dir))
        if rank == 0:
            wait(build_dir, build, timeout_s, progress, lambda: done_count(build_dir) == len(spec.parts))
            _publish(build_dir, path, spec)
        else:
            wait(build_dir, build, timeout_s, progress, lambda: verify(path, spec.fingerprint) is None)
    except (OSError, DataError):
        # Another job building the same store (a sweep's first jobs start together) published it first: its build
        # dir, this job's too, became the store while this one built or waited.
        if verify(path, spec.fingerprint) is not None:
            raise
    return TokenStore(path)
