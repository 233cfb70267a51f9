"""Against peers, side by side in one run (same model, batch, data and ranks, alternated repeats):
our trainer with sharding=ddp (FSDP2 replicated), ddp_classic (torch's DDP) and blockwise, Hugging Face
Accelerate (on GPU its FSDP2, each block wrapped; on CPU its multi-CPU data parallel: Accelerate's FSDP2 does not
shard on CPU, each process would run the whole unwrapped model), and the bare per-block fully_shard + AdamW loop
(the floor). Steady-state tokens/s.

    pip install accelerate   # bench only: the package never imports it
    .venv/bin/python bench/peers.py [--nproc 2] [--steps 40] [--repeats 3] [overrides ...]
"""

import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from overhead import alternate, bare_loop, bench_main, seconds_per_step, trainer_step_time  # noqa: E402 (bench/ is on sys.path)
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.data.pipeline import build_data  # noqa: E402
from fsdp_research.distributed.processes import device_for, init_distributed  # noqa: E402
from fsdp_research.model.architecture import block_class_name, build_hf_config, build_model  # noqa: E402
from fsdp_research.model.initialization import init_weights, materialize  # noqa: E402


def _accelerator(model, bf16: bool):
    """Accelerate's FSDP2 on GPU (each block wrapped, as our blockwise), its multi-CPU data parallel on CPU."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    mixed = "bf16" if bf16 else "no"
    if not torch.cuda.is_available():
        return Accelerator(cpu=True, mixed_precision=mixed)
    block = block_class_name(model, None)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=[block]
    )
    return Accelerator(mixed_precision=mixed, fsdp_plugin=plugin)


def accelerate_loop(cfg, steps: int) -> float:
    """Seconds per step after warmup of the loop Accelerate's docs teach: its FSDP2 on GPU (checked to be
    wrapped block by block), its multi-CPU data parallel on CPU."""
    t = cfg.trainer
    hf_config = build_hf_config(cfg.model)
    data = build_data(cfg.data, hf_config.vocab_size, t.seed)
    model = build_model(hf_config)
    materialize(model, torch.device("cpu"), torch.device("cpu"))
    init_weights(model, [], t.seed)
    accelerator = _accelerator(model, cfg.precision.param_dtype == "bfloat16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    if torch.cuda.is_available():
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(units) > 1, f"Accelerate did not shard block by block: {len(units)} FSDP unit(s)"
    else:
        assert accelerator.distributed_type.value == "MULTI_CPU" or dist.get_world_size() == 1
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(s: int) -> None:
        batch = data.rank_batch(s * t.global_batch_size, t.global_batch_size, rank, world).to(accelerator.device)
        logits = model(input_ids=batch[:, :-1]).logits
        accelerator.backward(F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()))
        accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()

    return seconds_per_step(step, steps)


ACCELERATE = "accelerate FSDP2" if torch.cuda.is_available() else "accelerate multi-CPU DDP"


def _bench(container, steps: int, repeats: int, out: str) -> None:
    base = typed(container)
    init_distributed(base.distributed, device_for("auto", 0))
    ddp = typed({**container, "sharding": {"strategy": "ddp"}})
    classic = typed({**container, "sharding": {"strategy": "ddp_classic"}})
    alternate(
        {
            "trainer ddp": lambda r: trainer_step_time(ddp, os.path.join(out, f"ddp{r}")),
            "trainer ddp_classic": lambda r: trainer_step_time(classic, os.path.join(out, f"classic{r}")),
            "trainer blockwise": lambda r: trainer_step_time(base, os.path.join(out, f"blockwise{r}")),
            ACCELERATE: lambda r: accelerate_loop(base, steps),
            "bare fully_shard loop": lambda r: bare_loop(base, steps),
        },
        repeats,
        out,
    )


def main() -> None:
    args, cfg, times = bench_main(_bench, default_steps=40)
    times = {name: statistics.median(v) for name, v in times.items()}
    tokens = cfg.trainer.global_batch_size * cfg.data.seq_len
    ours = times["trainer ddp"]
    print(
        f"{args.nproc} ranks, {cfg.model.name}, {cfg.precision.name}, global batch {cfg.trainer.global_batch_size} "
        f"x {cfg.data.seq_len} tokens, median of {args.repeats} alternated repeats"
    )
    for name, seconds in times.items():
        print(
            f"{name:>26}: {tokens / seconds:9,.0f} tokens/s ({seconds * 1e3:.1f} ms/step); "
            f"trainer ddp / this = {seconds / ours:.2f}x"
        )


if __name__ == "__main__":
    main()
