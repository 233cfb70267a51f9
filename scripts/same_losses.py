"""Same losses before and after a change that should change nothing: a few short runs (the default job, tp=2, cp=2,
ep=2, hsdp on 4 ranks, accumulation with and without defer_grad_sync, chat SFT at 2 ranks) at two checkouts, each
step's loss and gradient norm compared for equality, to the bit.

    git worktree add /tmp/before <commit>
    .venv/bin/python scripts/same_losses.py /tmp/before . [RUN ...]

The runs use this checkout's .venv; each checkout's own package is imported (its train.py's folder comes first on
the path). ep=2 trains a tiny qwen3_moe, sft2 a chat llama on chats, written once by the tests' helpers. Exits 1 if
any run differs."""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.join(REPO, ".venv", "bin", "python")
TWO = ["precision=fp32", "trainer.max_steps=4", "distributed.nproc_per_node=2"]
ACCUMULATE = [*TWO, "trainer.global_batch_size=16", "trainer.micro_batch_size=2"]
RUNS = {
    "default": ["trainer.max_steps=6"],
    "tp2": [*TWO, "parallel.tp=2"],
    "cp2": [*TWO, "parallel.cp=2"],
    "ep2": [*TWO, "parallel.ep=2", "model=pretrained", "model.name_or_path={moe}"],
    "hsdp4": ["precision=fp32", "trainer.max_steps=4", "distributed.nproc_per_node=4", "sharding=hsdp"]
    + ["sharding.replicate=2", "trainer.micro_batch_size=4"],
    "accum": ACCUMULATE,
    "accum_defer": [*ACCUMULATE, "trainer.defer_grad_sync=true"],
    # Packed chat samples: their loss sums weighted by the step's targets over ranks and micro-batches.
    "sft2": [*TWO, "model=pretrained", "model.name_or_path={chat}", "data=chat", "data.paths=[{chats}]"]
    + ["data.seq_len=192", "trainer.global_batch_size=4", "trainer.micro_batch_size=1"],
}
QUIET = ["logger=none", "trainer.log_interval=1", "checkpoint.save=false", "checkpoint.export=false"]


def _steps(root: str, name: str, out: str, made: dict[str, str]) -> list[tuple]:
    run_dir = os.path.join(out, os.path.basename(os.path.abspath(root)), name)
    overrides = [o.format(**made) for o in RUNS[name]]
    command = [PYTHON, os.path.join(root, "train.py"), *QUIET, *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} at {root} failed: {done.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r.get("grad_norm")) for r in map(json.loads, f) if "loss" in r]


def _made(out: str) -> dict[str, str]:
    """What the runs read, written once by the tests' helpers: a tiny qwen3_moe, a chat llama and chats."""
    made = {"moe": os.path.join(out, "qwen3_moe"), "chat": os.path.join(out, "chat_llama")}
    made["chats"] = os.path.join(out, "chats.jsonl")
    if not all(os.path.exists(p) for p in made.values()):
        sys.path.insert(0, REPO)
        from tests.helpers.chats import CONVERSATIONS, chat_llama, write_chats
        from tests.helpers.zoo import initial_weights

        initial_weights("qwen3_moe", made["moe"])
        chat_llama(made["chat"])
        write_chats(made["chats"], CONVERSATIONS * 8)
    return made


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("runs", nargs="*", help=f"some of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--out", default="/tmp/same_losses")
    args = parser.parse_args()
    if set(args.runs) - RUNS.keys():
        parser.error(f"unknown runs {sorted(set(args.runs) - RUNS.keys())}: choose from {', '.join(RUNS)}")
    made = _made(args.out)
    differ = 0
    for name in args.runs or RUNS:
        before, after = (_steps(root, name, args.out, made) for root in (args.before, args.after))
        differ += before != after
        print(f"{name}: {'equal' if before == after else 'DIFFER'} (last step, loss, grad_norm: {after[-1]})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
