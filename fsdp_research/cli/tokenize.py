"""fsdp-research tokenize <data overrides...>: the config's token stores built ahead of training, with every core
of this node (data.build_workers), e.g. in a CPU-only SLURM job, where each srun task takes its share of the parts;
a progress bar while it runs, and the rate at the end. A store that exists is only opened. data=chat: the
conversations' stores (fsdp_research.data.chat_store), training and eval."""

import argparse
import os
import secrets
import sys
import time
from collections.abc import Sequence

from fsdp_research.cli.common import fail
from fsdp_research.data.pipeline import Build, open_stores, store_root, store_specs
from fsdp_research.data.store import verify
from fsdp_research.distributed.processes import cores_per_rank, launch_env
from fsdp_research.errors import ConfigError, DataError
from fsdp_research.jobs.compose import compose
from fsdp_research.train.refusals import check_sources


def _bar(done: int, total: int, seconds: float) -> None:
    filled = int(30 * done / max(total, 1))
    line = f"[{'#' * filled:<30}] {done}/{total} parts, {seconds:.0f} s"
    if sys.stdout.isatty():
        print(f"\r{line}", end="", flush=True)
    else:
        print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research tokenize", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides as for train.py (data.*)")
    args = parser.parse_intermixed_args(argv)
    env = launch_env()
    rank, world = (env.rank, env.world_size) if env else (0, 1)
    # Every task of one srun step names the same build (a requeued job another: the dead one's claims stay
    # behind); alone, any name will do.
    slurm = os.environ.get("SLURM_JOB_ID")
    name = (
        f"slurm-{slurm}.{os.environ.get('SLURM_STEP_ID', 0)}.{os.environ.get('SLURM_RESTART_COUNT', 0)}"
        if env and slurm
        else secrets.token_hex(8)
    )
    try:
        cfg = compose(args.overrides)
        check_sources(cfg.data)
        root = store_root(cfg.data)
        existed = {
            s.fingerprint
            for s in store_specs(cfg.data)
            if verify(os.path.join(root, s.fingerprint), s.fingerprint) is None
        }
        started = time.perf_counter()
        workers = cfg.data.build_workers or cores_per_rank()
        build = Build(rank, world, workers, name, _bar if rank == 0 else None, 1.0, cfg.distributed.timeout_s)
        stores = open_stores(cfg.data, build)
    except (ConfigError, DataError) as err:
        return fail(err)
    seconds = time.perf_counter() - started
    if sys.stdout.isatty():
        print()
    for store in stores:
        m = store.manifest
        text = f", {m['text_bytes'] / 1e6:,.1f} MB of text" if m["text_bytes"] else ""  # conversations: not counted
        print(
            f"token store {store.path}: {m['tokens']:,} tokens ({m['dtype']}), {m['documents']:,} documents{text}"
            + (" (already built)" if m["fingerprint"] in existed else "")
        )
    built = [s.manifest for s in stores if s.manifest["fingerprint"] not in existed]
    if built:
        text = sum(m["text_bytes"] for m in built)
        rate = (
            f"{text / 1e6 / seconds:,.1f} MB/s of text"
            if text
            else f"{sum(m['tokens'] for m in built) / seconds:,.0f} tokens/s"
        )
        print(f"built in {seconds:.1f} s: {rate}")
    return 0
