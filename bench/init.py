"""Initialisation's cost per rank at 1 and 4 ranks (real gloo processes, llama_1b by default): each rank plans,
shards and initialises its shard as the trainer does (fsdp_research.tools.simulate.set_up_shard); per phase the wall
time, this process's CPU time, and its peak resident memory. On a 2-core machine 4 ranks share the cores: CPU
time per rank is the cost that must fall with ranks (wall time shows the sharing).

    .venv/bin/python bench/init.py [--worlds 1 4] [overrides ...]
"""

import argparse
import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.distributed.processes import init_distributed, spawn  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402
from fsdp_research.model.architecture import build_hf_config  # noqa: E402
from fsdp_research.tools.simulate import as_dict, set_up_shard  # noqa: E402


def _rank(overrides: list[str], out: str) -> None:
    import torch.distributed as dist

    cfg = compose(overrides)
    init_distributed(typed(cfg).distributed, torch.device("cpu"))
    phases = []
    set_up_shard(cfg, build_hf_config(cfg.model), torch.device("cpu"), phases)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, as_dict(phases))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = ["model=llama_1b", "logger=none", "trainer.global_batch_size=16", *args.overrides]
    print(f"{' '.join(overrides)}: per phase, the largest over ranks of wall s / CPU s / peak RSS GiB / shard GiB")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = os.path.join(tmp, f"{world}.json")
            spawn(_rank, world, overrides, out)
            with open(out) as f:
                ranks = json.load(f)
            for name in ("plan", "shard", "init"):
                rows = [next(p for p in phases if p["name"] == name) for phases in ranks]
                shard = max(r["tensors"].get("params", 0) for r in rows) / 2**30
                print(
                    f"  {world} rank(s) {name:>6}: {max(r['seconds'] for r in rows):7.2f} s"
                    f" {max(r['cpu_seconds'] for r in rows):7.2f} cpu s {max(r['peak_rss_gib'] for r in rows):6.2f} GiB"
                    + (f"  shard {shard:.2f} GiB" if shard else "")
                )


if __name__ == "__main__":
    main()
