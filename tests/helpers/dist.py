"""Real multi-process runs for tests (as OLMo-core's run_distributed_test): a function on N fresh processes on
gloo, started the way train.py starts its workers, every log line tagged with its rank; rank 0's return value
comes back to the test."""

import faulthandler
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.processes import spawn
from fsdp_research.train.trainer import train
from tests.helpers.forked import PRELOAD

# Longer than any test's ranks run (the census's pools: ~4 min in CI): ranks still going then are stuck (ranks waiting
# on each other's different collectives wait out the group's timeout, then each next one's). Each writes every
# thread's stack to its stderr and leaves, so that the test fails with where it hung instead of CI's time running out.
HUNG_S = 900


def _leave_when_hung() -> None:
    faulthandler.dump_traceback_later(HUNG_S, exit=False)  # from C: it writes even while a thread holds the GIL

    def leave() -> None:
        time.sleep(HUNG_S + 5)
        os._exit(3)

    threading.Thread(target=leave, name="hung-rank-exit", daemon=True).start()


def _run_and_keep(fn: Callable, args: tuple, path: str) -> None:
    _leave_when_hung()
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", force=True)
    result = fn(*args)
    if rank == 0:
        torch.save(result, path)
    if dist.is_initialized():
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's threads can abort the process ("terminate called
    # without an active exception", seen once on rank 1 after a run that passed), as the launcher's workers do.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> Any:
    """fn(*args) on world_size new processes (a module-level function; it joins the process group through the
    library's init_distributed, as the trainer does); returns what rank 0's call returned. The processes are
    forked from the suite's forkserver: each test's ranks are new processes, with nothing left by another test."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pt")
        spawn(_run_and_keep, world_size, fn, args, path, preload=PRELOAD)
        return torch.load(path, weights_only=False)


def _as_rank_0_of(world_size: int, fn: Callable, args: tuple) -> Any:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return fn(*args)


def run_fake(fn: Callable, world_size: int, *args: Any) -> Any:
    """fn(*args) as rank 0 of `world_size` ranks on torch's fake process group, in one forked process (torchtitan
    checks an N-GPU configuration so): collectives return at once and move no data, so a rank's shapes, buffers and
    memory are as on real ranks, its values are not. For what depends on shapes alone (the planner's tracker)."""
    return run_distributed(_as_rank_0_of, 1, world_size, fn, args)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded weights on CPU (a collective: every rank calls it)."""
    model = getattr(model, "module", model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_name(k): v for k, v in state.items()}


def final_weights(model: torch.nn.Module) -> dict[str, Any]:
    return {"weights": full_state(model)}


def in_turn(names: Iterable[str], one: Callable[[str], Any]) -> dict[str, Any]:
    """one(name) for each name in turn on this process's rank; a name whose call raises gets {"error": its
    traceback}. The rest still run on one rank; on several, they are not run: a rank that raised may have left the
    others in a collective it never joins (they raise at the group's timeout, then stop too)."""
    records: dict[str, Any] = {}
    failed = None
    for name in names:
        if failed and dist.is_initialized() and dist.get_world_size() > 1:
            records[name] = {"error": f"not run: {failed} raised before it on this rank"}
            continue
        try:
            records[name] = one(name)
        except Exception:  # the test of this one names it; the log, the rank that raised first
            logging.exception(f"{name} raised")
            records[name], failed = {"error": traceback.format_exc()}, name
    return records


def _train_each(configs: dict[str, Any], out_dir: str, inspect: Callable) -> dict[str, Any]:
    def one(name: str) -> dict[str, Any]:
        result = train(configs[name], os.path.join(out_dir, name))
        return {"losses": result.losses, **inspect(result.model)}

    return in_turn(configs, one)


def train_distributed(
    configs: dict[str, Any],
    world_size: int,
    out_dir: str,
    inspect: Callable[[torch.nn.Module], dict[str, Any]] = final_weights,
) -> dict[str, Any]:
    """Train each config in turn on the same `world_size` processes (run dirs <out_dir>/<name>); returns their
    losses and what `inspect(trained model)` found (a module-level function; every rank calls it, so it may
    use collectives), by default the final weights; or {"error": rank 0's traceback} for a config that raised."""
    containers = {name: OmegaConf.to_container(cfg, resolve=True) for name, cfg in configs.items()}
    return run_distributed(_train_each, world_size, containers, out_dir, inspect)


def each_family(one: Callable, initials: dict[str, str], *args: Any) -> dict[str, Any]:
    """On this process's rank (joining the group as the trainer does): one(family, initial, *args) for each family
    in turn (in_turn)."""
    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.jobs.compose import compose

    init_distributed(typed(compose([])).distributed, torch.device("cpu"))
    return in_turn(initials, lambda family: one(family, initials[family], *args))


def ok(records: dict[str, Any], name: str) -> dict[str, Any]:
    """The record of one config, failing the test with its traceback if it raised."""
    assert "error" not in records[name], f"{name} raised:\n{records[name]['error']}"
    return records[name]
