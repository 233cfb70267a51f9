"""Fine-tuning figures, whole runs side by side (`python train.py ...`, alternated, each run's medians over its
steps after the first few): on chats of examples/fine_tune/make_data.py (short conversations), packed windows
(data.packing=true, the default) against one conversation per window, in tokens/s (every position) and target
tokens/s (the positions that train); LoRA (model.lora.r) against a full fine-tune: step time and peak memory
(the process's peak RSS on the CPU, the device's peak on a GPU); and TRL's SFTTrainer on the same chats, model,
window length and windows a step (packing=True: its best-fit decreasing, assistant_only_loss; fp32, against ours
in fp32): the share of its packed windows' positions that are targets, and target tokens/s.

    .venv/bin/python bench/sft.py [--steps 30] [--repeats 2] [--hidden 512] [--layers 8] [--seq-len 512] [overrides ...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from fine_tune_runs import WARMUP, arguments, make_data, step_clock, train_run

CASES = {
    "packed, full": [],
    "one per window, full": ["data.packing=false"],
    "packed, LoRA r=16": ["model.lora.r=16", "model.lora.alpha=32"],
    "packed, full, fp32": ["precision=fp32"],
    "TRL SFTTrainer, fp32": None,
}
# make_data.py's template with the assistant's turns marked, as TRL's assistant_only_loss needs (the same text).
MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _trl(tmp: str, steps: int, seq_len: int) -> dict:
    """In this process: TRL's SFTTrainer on tmp's chats and model; the target share of its packed windows (the
    positions its labels train, from the assistant masks, over windows x seq_len) and its step times."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(f"{tmp}/model")
    tok.chat_template = MARKED
    seconds: list[float] = []

    config = SFTConfig(
        output_dir=f"{tmp}/trl", max_length=seq_len, packing=True, assistant_only_loss=True,
        per_device_train_batch_size=8, max_steps=steps, learning_rate=3e-4, logging_steps=steps,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(f"{tmp}/model"),
        args=config,
        train_dataset=load_dataset("json", data_files=f"{tmp}/train.jsonl", split="train"),
        processing_class=tok,
        callbacks=[step_clock(seconds)],
    )
    packed = trainer.train_dataset
    share = sum(sum(label != -100 for label in row) for row in packed["labels"]) / (len(packed) * seq_len)
    trainer.train()
    step_s = statistics.median(seconds[WARMUP:])
    return {"step_s": step_s, "tokens_s": 8 * seq_len / step_s, "targets_s": share * 8 * seq_len / step_s,
            "target_share": share, "peak_gib": float("nan")}  # fmt: skip


def _run(tmp: str, name: str, repeat: int, args, extra: list[str] | None) -> dict:
    if extra is None:  # TRL's, in a process of its own as ours
        cmd = [sys.executable, __file__, "--trl", tmp, "--steps", str(args.steps), "--seq-len", str(args.seq_len)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    run_dir = os.path.join(tmp, f"case{list(CASES).index(name)}_{repeat}")
    extra = ["data=chat", f"data.paths=[{tmp}/train.jsonl]", *extra, *args.overrides]
    steps, summary = train_run(tmp, run_dir, name, args.steps, args.seq_len, extra)
    step_s = statistics.median(r["step_time_s"] for r in steps)
    positions = 8 * args.seq_len
    targets = statistics.median(r["targets"] for r in steps)
    peak = summary.get("peak_device_gib") or summary.get("peak_rss_gib")
    return {"step_s": step_s, "tokens_s": positions / step_s, "targets_s": targets / step_s,
            "target_share": targets / positions, "peak_gib": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    arguments(parser, 30, "(internal) run TRL's case on DIR's chats, print its figures")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.trl:
        print(json.dumps(_trl(args.trl, args.steps, args.seq_len)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        make_data(tmp, args)
        results: dict[str, list[dict]] = {name: [] for name in CASES}
        for repeat in range(args.repeats):
            for name, extra in CASES.items():
                results[name].append(_run(tmp, name, repeat, args, extra))
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    print(f"llama hidden {args.hidden} x {args.layers} layers, seq_len {args.seq_len}, 8 windows a step, "
          f"medians of {args.repeats} alternated runs of {args.steps} steps (steps > {WARMUP})")  # fmt: skip
    print(f"{'case':<24}{'step s':>9}{'tokens/s':>11}{'targets/s':>11}{'target share':>14}{'peak GiB':>10}")
    for name, m in med.items():
        print(f"{name:<24}{m['step_s']:>9.3f}{m['tokens_s']:>11,.0f}{m['targets_s']:>11,.0f}"
              f"{m['target_share']:>14.1%}{m['peak_gib']:>10.3f}")  # fmt: skip
    full, unpacked, lora, fp32, trl = (med[n] for n in CASES)
    print(f"packed / one per window: target tokens/s x{full['targets_s'] / unpacked['targets_s']:.2f}")
    print(
        f"ours / TRL's SFTTrainer (fp32): target share x{fp32['target_share'] / trl['target_share']:.3f}, "
        f"target tokens/s x{fp32['targets_s'] / trl['targets_s']:.2f}"
    )
    time_ratio, peak_ratio = lora["step_s"] / full["step_s"], lora["peak_gib"] / full["peak_gib"]
    print(f"LoRA / full: step time x{time_ratio:.2f}, peak memory x{peak_ratio:.2f}")


if __name__ == "__main__":
    main()
