"""The seed's training loop and nothing else, as bench/overhead.py's floor: `from_pretrained`, `fully_shard` per
decoder layer (reshard after forward except the last) then the root, torch.optim.AdamW, random tokens,
`model(input_ids=x, labels=x).loss.backward(); opt.step(); opt.zero_grad()`; bf16 with the seed's
MixedPrecisionPolicy(param bf16, reduce fp32). No clipping, no data pipeline, no metrics. Launched by torchrun:

    torchrun --nproc_per_node 2 bench/seed_loop.py <model dir> --batch 4 --micro-batch 4 --seq-len 256 --steps 30

Rank 0 prints one JSON line: {"step_time_s": [...]} (each step's wall time, rank 0's clock)."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, required=True, help="sequences per rank and step")
    parser.add_argument("--micro-batch", type=int, required=True, help="sequences per forward")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    bf16 = args.precision == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(dist.get_rank())
    micro_steps = args.batch // args.micro_batch
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        for _ in range(micro_steps):
            x = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=g)
            (model(input_ids=x, labels=x).loss / micro_steps).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(json.dumps({"step_time_s": times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
