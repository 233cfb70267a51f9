"""objective=grpo beside TRL's GRPOTrainer on the same job, whole runs alternated: examples/fine_tune/make_data.py's
llama and prompts (a sum asked, as messages), the reward examples.fine_tune.rewards.digits (the share of digit
characters: a random model's completions differ in it) and the same settings on both: fp32, 16 completions a step in
one micro-batch, 4 a prompt, 16 tokens at most, temperature 1, beta 0, loss dapo, AdamW (0.9, 0.999) without weight
decay, lr 1e-2 constant, gradient clip 1. Printed: each run's reward over its steps (the means of its first and last
5), its step time and tokens a second (prompts' and completions' tokens, as TRL's num_tokens counts them; medians
after the first 4 steps). The prompts come in another order on each (TRL's sampler, our data order): the curves are
alike, not equal.

    .venv/bin/python bench/grpo.py [--steps 30] [--repeats 1] [--hidden 128] [--layers 4] [overrides]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from fine_tune_runs import ROOT, WARMUP, arguments, make_data, train_run, trl_run

COMPLETIONS, GROUP, LENGTH, LR = 16, 4, 16, 1e-2
EDGE = 5  # the reward's first and last steps compared


def _trl(tmp: str, steps: int) -> dict:
    """In this process: TRL's GRPOTrainer on tmp's model and prompts."""
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, ROOT)
    from examples.fine_tune.rewards import digits

    config = GRPOConfig(
        output_dir=f"{tmp}/trl", per_device_train_batch_size=COMPLETIONS, num_generations=GROUP,
        max_completion_length=LENGTH, temperature=1.0, beta=0.0, loss_type="dapo", learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer, seconds = trl_run(GRPOTrainer, config, tmp, "prompts_train", reward_funcs=digits)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip(logs, logs[1:])]
    return {
        "reward": [h["reward"] for h in logs],
        "step_s": statistics.median(seconds[WARMUP:]),
        "tokens_s": statistics.median(n / s for n, s in zip(tokens[WARMUP - 1 :], seconds[WARMUP:])),
    }


def _ours(tmp: str, repeat: int, args) -> dict:
    overrides = [
        "data=prompts", f"data.paths=[{tmp}/prompts_train.jsonl]", "objective=grpo",
        "objective.reward_funcs=[examples.fine_tune.rewards.digits]", f"objective.num_generations={GROUP}",
        f"objective.max_completion_length={LENGTH}", "objective.loss_type=dapo", "precision=fp32", f"optim.lr={LR}",
        "optim.weight_decay=0", "optim.betas=[0.9,0.999]", "optim.grad_clip=1.0", "schedule=constant",
        "schedule.warmup_steps=0", *args.overrides,
    ]  # fmt: skip
    run_dir = os.path.join(tmp, f"ours_{repeat}")
    train_run(tmp, run_dir, "ours", args.steps, args.seq_len, overrides, batch=COMPLETIONS)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "reward" in r]
    later = [r for r in steps if r["step"] > WARMUP]
    return {
        "reward": [r["reward"] for r in steps],
        "step_s": statistics.median(r["step_time_s"] for r in later),
        "tokens_s": statistics.median(r["tokens_per_s"] for r in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    arguments(parser, 30, "(internal) run TRL's case on DIR's prompts, print its figures")
    parser.set_defaults(repeats=1, hidden=128, layers=4, seq_len=48)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.trl:
        print(json.dumps(_trl(args.trl, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_data(tmp, args)
        runs: dict[str, list[dict]] = {"ours": [], "TRL GRPOTrainer": []}
        for repeat in range(args.repeats):
            runs["ours"].append(_ours(tmp, repeat, args))
            cmd = [sys.executable, __file__, "--trl", tmp, "--steps", str(args.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            runs["TRL GRPOTrainer"].append(json.loads(out.splitlines()[-1]))
    print(
        f"llama hidden {args.hidden} x {args.layers} layers, {COMPLETIONS} completions a step ({GROUP} a prompt, <= "
        f"{LENGTH} tokens), {args.steps} steps, {args.repeats} run(s) each, medians after step {WARMUP}"
    )
    print(f"{'case':<18}{'reward first':>14}{'reward last':>13}{'step s':>9}{'tokens/s':>10}")
    med = {}
    for name, rows in runs.items():
        first = statistics.median(statistics.mean(r["reward"][:EDGE]) for r in rows)
        last = statistics.median(statistics.mean(r["reward"][-EDGE:]) for r in rows)
        med[name] = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "tokens_s")}
        print(f"{name:<18}{first:>14.3f}{last:>13.3f}{med[name]['step_s']:>9.3f}{med[name]['tokens_s']:>10.0f}")
        print(f"  reward by step: {' '.join(f'{x:.2f}' for x in rows[0]['reward'])}")
    ours, trl = med["ours"], med["TRL GRPOTrainer"]
    ratios = ours["step_s"] / trl["step_s"], ours["tokens_s"] / trl["tokens_s"]
    print(f"ours / TRL's: step time x{ratios[0]:.2f}, tokens/s x{ratios[1]:.2f}")


if __name__ == "__main__":
    main()
