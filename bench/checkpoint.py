"""Resume-checkpoint speed: DCP save/load (every rank writes its own shard) against gathering a full state
dict on rank 0 plus torch.save (every rank then torch.loads the whole file), same model and optimizer state,
same ranks, alternated in one run; and for checkpoint.async=true, how much of the save the training loop still
waits for.

    .venv/bin/python bench/checkpoint.py [--nproc 2] [--repeats 3] [overrides ...]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402

from fsdp_research.checkpoint.dcp import Checkpointer  # noqa: E402
from fsdp_research.checkpoint.resume import load_checkpoint  # noqa: E402
from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.distributed.processes import device_for, init_distributed, spawn  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402
from fsdp_research.model.architecture import build_hf_config  # noqa: E402
from fsdp_research.model.assembly import build_sharded_model  # noqa: E402
from fsdp_research.optim import build_optimizer  # noqa: E402

# A mid-size llama (~33M parameters; ~0.4 GB of model + AdamW state): large enough for I/O to dominate.
MODEL = [
    "model.config.hidden_size=512",
    "model.config.intermediate_size=1376",
    "model.config.num_hidden_layers=8",
    "model.config.vocab_size=8192",
]


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _train_step(model, optimizer, batch) -> None:
    logits = model(input_ids=batch[:, :-1]).logits
    F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _bench(container, repeats: int, out: str) -> None:
    cfg = typed(container)
    device = device_for("auto", 0)
    init_distributed(cfg.distributed, device)
    rank = dist.get_rank()
    hf_config = build_hf_config(cfg.model)
    model, _ = build_sharded_model(cfg, hf_config, device, dist.get_world_size())
    optimizer, _ = build_optimizer(model, cfg)
    batch = torch.randint(0, hf_config.vocab_size, (2, 129), device=device)
    _train_step(model, optimizer, batch)  # optimizer state exists
    full_path = os.path.join(out, "full.pt")
    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_save():
        model_sd, optim_sd = get_state_dict(model, optimizer, options=full_opts)
        if rank == 0:
            torch.save({"model": model_sd, "optim": optim_sd}, full_path)

    def full_load():
        state = torch.load(full_path, weights_only=False)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(full_state_dict=True),
        )

    times = {k: [] for k in ("dcp_save", "dcp_load", "full_save", "full_load", "async_blocking", "unpinned_blocking")}
    sync = Checkpointer(cfg.checkpoint, os.path.join(out, "sync"), {})
    cfg.checkpoint["async"] = True
    asynchronous = Checkpointer(cfg.checkpoint, os.path.join(out, "async"), {})
    # On CUDA the async saves stage into reused pinned memory; DCP's own staging beside them.
    unpinned = Checkpointer(cfg.checkpoint, os.path.join(out, "unpinned"), {}, pinned=False)
    for r in range(repeats):
        step = r + 1
        times["dcp_save"].append(_timed(lambda: sync.save(step, model, optimizer, {"step": step})))
        step_dir = os.path.join(out, "sync", "checkpoints", f"step_{step}")
        times["dcp_load"].append(_timed(lambda: load_checkpoint(step_dir, model, optimizer)))
        times["full_save"].append(_timed(full_save))
        times["full_load"].append(_timed(full_load))
        for name, checkpointer in (("async_blocking", asynchronous), ("unpinned_blocking", unpinned)):
            if name == "unpinned_blocking" and not torch.cuda.is_available():
                continue  # the same as the pinned one off CUDA
            times[name].append(_timed(lambda: checkpointer.save(step, model, optimizer, {"step": step})))
            for _ in range(3):  # the loop goes on while the shards are written
                _train_step(model, optimizer, batch)
            times[name][-1] += _timed(checkpointer.wait)
    if rank == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(
                {
                    **times,
                    "size_mb": sum(os.path.getsize(os.path.join(step_dir, n)) for n in os.listdir(step_dir)) / 1e6,
                },
                f,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["precision=fp32", "checkpoint.keep_last=1", *MODEL, *args.overrides])
    out = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    try:
        spawn(_bench, args.nproc, OmegaConf.to_container(cfg, resolve=True), args.repeats, out)
        with open(os.path.join(out, "times.json")) as f:
            times = json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items() if isinstance(v, list) and v}
    print(
        f"{args.nproc} ranks, checkpoint {times['size_mb']:.0f} MB (model + AdamW state), "
        f"median of {args.repeats} alternated repeats"
    )
    print(
        f"save: DCP {med['dcp_save']:.2f} s | full state dict on rank 0 + torch.save {med['full_save']:.2f} s | "
        f"ratio {med['full_save'] / med['dcp_save']:.2f}x"
    )
    print(
        f"load: DCP {med['dcp_load']:.2f} s | torch.load of the full file on every rank {med['full_load']:.2f} s | "
        f"ratio {med['full_load'] / med['dcp_load']:.2f}x"
    )
    print(
        f"async save: the loop waits {med['async_blocking']:.2f} s of a sync save's {med['dcp_save']:.2f} s "
        f"({100 * med['async_blocking'] / med['dcp_save']:.0f}%)"
        + (
            f"; with DCP's default staging, unpinned: {med['unpinned_blocking']:.2f} s"
            if "unpinned_blocking" in med
            else ""
        )
    )


if __name__ == "__main__":
    main()
