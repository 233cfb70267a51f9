"""The measured saving of each FSDP2 knob on the mid-size llama (model=llama_mid, 24M parameters), each
against the plain config (blockwise sharding, no activation checkpointing, whole logits) on the same ranks in the
same run: peak memory per rank of one training step (forward, backward, clipping, AdamW), as torch's FSDP memory
tracker counts it (parameters, gradients, optimizer state, activations, temporaries; the max over ranks), and the
median step time over steps alternated between the configs, so slow phases of the machine hit all alike.

    .venv/bin/python bench/knobs.py [--steps 4] [--no-4-ranks] [overrides ...]

fp32 (bf16 matmuls on CPU are slower than fp32 ones), sequences of 256 tokens; gloo on CPU, NCCL where there are
GPUs (one per rank). Three groups, each with its own plain row: the knobs at llama_mid's own vocabulary (512) on 2
ranks, micro-batch 2; loss.chunks at a 32000-token vocabulary and micro-batch 4, where the logits weigh (2 ranks);
reshard_after_forward=2, which needs 4 ranks (micro-batch 2). cpu_offload runs on GPUs only: on the CPU it would move
nothing. Step times on a 2-core machine are noisy:
read ratios far from 1, not the second decimal.
"""

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.distributed.processes import device_for, init_distributed, spawn  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402
from fsdp_research.model.architecture import build_hf_config  # noqa: E402
from fsdp_research.model.assembly import build_sharded_model  # noqa: E402
from fsdp_research.optim import build_optimizer, clip_grad_norm  # noqa: E402
from fsdp_research.train.losses import build_loss, train_loss  # noqa: E402
from fsdp_research.train.refusals import check_config  # noqa: E402

MID = ["model=llama_mid", "precision=fp32", "logger=none", "data=synthetic", "data.seq_len=256"]
# Chunks save where a rank's logits outweigh the output layer's gathered weight, gradient and reduce-scatter
# buffers (tokens per rank >> hidden size): at 512 tokens (= llama_mid's hidden) the step's peak is the root's
# reduce-scatter at the end of backward, the same with or without chunks; at 1024 the loss's peak shows.
LARGE_VOCAB = ["model.config.vocab_size=32000"]
# (ranks, micro-batch, shared overrides, {row: its overrides}); each group's first row, plain, is its baseline.
GROUPS = [
    (
        2,
        2,
        [],
        {
            "plain": [],
            "activation_checkpointing=every_block": ["activation_checkpointing=every_block"],
            "activation_checkpointing=selective": ["activation_checkpointing=selective"],
            "reshard_after_forward=false": ["sharding.reshard_after_forward=false"],
            "prefetch_forward=2 prefetch_backward=2": ["sharding.prefetch_forward=2", "sharding.prefetch_backward=2"],
            "cpu_offload=true": ["sharding.cpu_offload=true"],
        },
    ),
    (2, 4, LARGE_VOCAB, {"plain": [], "loss.chunks=8": ["loss.chunks=8"]}),
    (4, 2, [], {"plain": [], "reshard_after_forward=2": ["sharding.reshard_after_forward=2"]}),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _step(model, optimizer, loss_fn, batch: torch.Tensor, grad_clip: float) -> None:
    """One step as the trainer takes it (one micro-batch, the configured loss)."""
    train_loss(model, batch, contextlib.nullcontext(), loss_fn)[0].backward()
    clip_grad_norm(model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _build(container: dict, device: torch.device):
    """The sharded model, its optimizer with its state made (one step), and its tracked peak bytes (max over ranks)."""
    cfg = typed(container)
    init_distributed(cfg.distributed, device)
    hf_config = build_hf_config(cfg.model)
    check_config(cfg, dist.get_world_size(), hf_config, device)
    model, plan = build_sharded_model(cfg, hf_config, device, dist.get_world_size())
    optimizer, _ = build_optimizer(model, cfg, plan.blocks)
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape = (cfg.trainer.micro_batch_size, cfg.data.seq_len + 1)
    batch = torch.randint(0, hf_config.vocab_size, shape, generator=gen).to(device)
    run = (model, optimizer, build_loss(cfg.loss), batch, cfg.optim.grad_clip)
    _step(*run)  # the optimizer's state exists from here: the second step is the steady state
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch,))
    with tracker:
        _step(*run)
    # The compute device's peak: under cpu_offload the host-resident shards are what it saves.
    peak = torch.tensor(float(tracker.get_tracker_snapshot("peak")[device]["Total"]), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return run, peak.item()


def _worker(groups: dict, steps: int, path: str) -> None:
    device = device_for("auto", int(os.environ.get("LOCAL_RANK", 0)))
    results = {}
    for title, configs in groups.items():
        built = {name: _build(container, device) for name, container in configs.items()}
        times = {name: [] for name in configs}
        for _ in range(steps):
            for name, (run, _) in built.items():
                _sync(device)
                started = time.perf_counter()
                _step(*run)
                _sync(device)
                times[name].append(time.perf_counter() - started)
        results[title] = {name: (peak, statistics.median(times[name])) for name, (_, peak) in built.items()}
        del built
        gc.collect()
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per config, after two untimed ones")
    parser.add_argument("--no-4-ranks", action="store_true", help="skip the 4-rank pair (reshard_after_forward=2)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    skipped = []
    by_ranks: dict[int, dict] = {}
    for ranks, micro, shared, rows in GROUPS:
        batch = [f"trainer.micro_batch_size={micro}", f"trainer.global_batch_size={micro * ranks}"]
        base = compose([*MID, *batch, *shared, *args.overrides])
        t, model = base.trainer, base.model
        title = (
            f"{model.name}, vocab {model.config.vocab_size}, {ranks} ranks, "
            f"{t.micro_batch_size} x {base.data.seq_len} tokens per rank"
        )
        if (ranks == 4 and args.no_4_ranks) or (gpus and ranks > gpus):
            skipped.append(title)
            continue
        if not gpus and "cpu_offload=true" in rows:
            rows = {k: v for k, v in rows.items() if k != "cpu_offload=true"}
            skipped.append("cpu_offload=true (no accelerator: the state is in host memory already)")
        by_ranks.setdefault(ranks, {})[title] = {
            name: OmegaConf.to_container(compose([*MID, *batch, *shared, *extra, *args.overrides]), resolve=True)
            for name, extra in rows.items()
        }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks, groups in by_ranks.items():
            path = os.path.join(tmp, f"{ranks}.pt")
            spawn(_worker, ranks, groups, args.steps, path)
            results.update(torch.load(path))
    where = f"{gpus} GPU(s), NCCL" if gpus else "CPU, gloo"
    print(f"fp32, {where}, median of {args.steps} alternated steps")
    head = ("peak (MiB)", "peak vs plain", "step s", "time vs plain")
    print(f"{'knob':<40}" + "".join(f"{h:>{len(h) + 2}}" for h in head))
    for title, rows in results.items():
        print(f"-- {title}")
        base_peak, base_time = rows["plain"]
        for name, (peak, seconds) in rows.items():
            cells = (
                f"{peak / 2**20:.1f}",
                f"{peak / base_peak:.2f}x",
                f"{seconds:.3f}",
                f"{seconds / base_time:.2f}x",
            )
            print(f"{name:<40}" + "".join(f"{c:>{len(h) + 2}}" for c, h in zip(cells, head)))
    for what in skipped:
        print(f"skipped: {what}")


if __name__ == "__main__":
    main()
