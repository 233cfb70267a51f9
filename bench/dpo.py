"""Preference figures, whole runs side by side (`python train.py ...`, alternated, each run's medians over its steps
after the first few) on the pairs of examples/fine_tune/make_data.py (a sum asked, the right answer chosen, a wrong
one rejected; messages): objective=dpo with LoRA (reference=auto: the adapters switched off, no second model)
against LoRA SFT on the same sequences (each pair's prompt + chosen and prompt + rejected as two conversations, the
same windows and tokens a step): step time and peak memory; full DPO (the reference a frozen copy) in fp32 against
TRL's DPOTrainer on the same pairs, model and pairs a step (its per_device_train_batch_size: our median pairs a
step; fp32, ref_model given): pairs/s and peak memory (each process's peak RSS on the CPU). --ranks 2: ours at 2
ranks, TRL's under torchrun (DDP on gloo; half the pairs a step each; its rank 0's peak).

    .venv/bin/python bench/dpo.py [--steps 20] [--repeats 2] [--hidden 512] [--layers 8] [--seq-len 512] [--ranks 1]
        [overrides]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

from fine_tune_runs import WARMUP, arguments, make_data, train_run, trl_run

LORA = ["model.lora.r=16", "model.lora.alpha=32"]
CASES = {
    "DPO, LoRA r=16": ["data=preference", "objective=dpo", *LORA],
    "SFT, LoRA r=16, same sequences": ["data=chat", *LORA],
    "DPO, full, fp32": ["data=preference", "objective=dpo", "precision=fp32"],
    "TRL DPOTrainer, fp32": None,
}


def _as_chats(tmp: str) -> None:
    """Each pair's two sequences as two conversations (pairs_train.jsonl -> pairs_as_chats.jsonl)."""
    with open(f"{tmp}/pairs_train.jsonl") as f, open(f"{tmp}/pairs_as_chats.jsonl", "w") as out:
        for pair in map(json.loads, f):
            for side in ("chosen", "rejected"):
                out.write(json.dumps({"messages": pair["prompt"] + pair[side]}) + "\n")


def _trl(tmp: str, steps: int, pairs: int) -> dict:
    """In this process (one of torchrun's): TRL's DPOTrainer (fp32, a frozen reference given) on tmp's pairs,
    `pairs` a step on each process."""
    from trl import DPOConfig, DPOTrainer

    config = DPOConfig(
        output_dir=f"{tmp}/trl", per_device_train_batch_size=pairs, max_steps=steps, learning_rate=3e-4,
        logging_steps=steps, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    _, seconds = trl_run(DPOTrainer, config, tmp, "pairs_train", ref_model=f"{tmp}/model")
    step_s = statistics.median(seconds[WARMUP:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {"step_s": step_s, "pairs_s": world * pairs / step_s, "pairs": world * pairs, "peak_gib": peak}


def _run(tmp: str, name: str, repeat: int, args, extra: list[str] | None, pairs: int) -> dict:
    if extra is None:  # TRL's, in a process of its own as ours
        ranks = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks)] if args.ranks > 1 else []
        cmd = [sys.executable, *ranks, __file__, "--trl", tmp, "--steps", str(args.steps)]
        cmd += ["--pairs", str(pairs // args.ranks)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    data = "pairs_as_chats" if "data=chat" in extra else "pairs_train"
    run_dir = os.path.join(tmp, f"case{list(CASES).index(name)}_{repeat}")
    steps, summary = train_run(
        tmp,
        run_dir,
        name,
        args.steps,
        args.seq_len,
        [
            f"data.paths=[{tmp}/{data}.jsonl]",
            f"distributed.nproc_per_node={args.ranks}",
            f"trainer.micro_batch_size={8 // args.ranks}",  # the 8 windows a step over the ranks
            *extra,
            *args.overrides,
        ],
    )
    step_s = statistics.median(r["step_time_s"] for r in steps)
    # Pairs a step (the preference objectives' targets); for SFT half its conversations, which the windows hold.
    pairs_a_step = statistics.median(r["targets"] for r in steps) if "data=preference" in extra else float("nan")
    peak = summary.get("peak_device_gib") or summary.get("peak_rss_gib")
    return {"step_s": step_s, "pairs_s": pairs_a_step / step_s, "pairs": pairs_a_step, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    arguments(parser, 20, "(internal) run TRL's case on DIR's pairs, print its figures")
    parser.add_argument("--pairs", type=int, default=0, help="(internal) TRL's pairs a step and process")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.trl:
        figures = _trl(args.trl, args.steps, args.pairs)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(figures))
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_data(tmp, args)
        _as_chats(tmp)
        results: dict[str, list[dict]] = {name: [] for name in CASES}
        pairs = 0
        for repeat in range(args.repeats):
            for name, extra in CASES.items():
                results[name].append(_run(tmp, name, repeat, args, extra, pairs))
                if name == "DPO, full, fp32":
                    pairs = round(results[name][-1]["pairs"])
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    print(
        f"llama hidden {args.hidden} x {args.layers} layers, seq_len {args.seq_len}, 8 windows a step, {args.ranks} "
        f"rank(s), medians of {args.repeats} alternated runs of {args.steps} steps (steps > {WARMUP})"
    )
    print(f"{'case':<32}{'step s':>9}{'pairs/step':>12}{'pairs/s':>10}{'peak GiB':>10}")
    for name, m in med.items():
        print(f"{name:<32}{m['step_s']:>9.3f}{m['pairs']:>12.0f}{m['pairs_s']:>10.1f}{m['peak_gib']:>10.3f}")
    lora, sft, full, trl = (med[n] for n in CASES)
    print(f"DPO LoRA / SFT LoRA on the same sequences: step time x{lora['step_s'] / sft['step_s']:.2f}, "
          f"peak memory x{lora['peak_gib'] / sft['peak_gib']:.3f}")  # fmt: skip
    print(f"ours / TRL's DPOTrainer (full, fp32): pairs/s x{full['pairs_s'] / trl['pairs_s']:.2f}, "
          f"peak memory x{full['peak_gib'] / trl['peak_gib']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
