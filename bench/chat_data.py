"""Chat data's start-up and memory, side by side in one run: --chats conversations (about 300 tokens each, of this
Python's standard-library sources) trained on by 2-rank runs of `train.py data=chat` (a small llama and a BPE
tokenizer with a ChatML template, made here): the first run builds the conversations' store, the second reads it.
Printed: each run's `data: ... ready in <s> s` line and its peak RSS per rank (the larger of the 2), beside the same
conversations' rendered text as a text corpus (its token store, built by its own first run).

    .venv/bin/python bench/chat_data.py [--chats 100000] [--seq-len 512] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import ROOT, train_bpe, write_corpus  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make(out: str, n: int) -> tuple[str, str, str]:
    """(model dir, conversations, the same rendered as text) under out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    corpus = write_corpus(os.path.join(out, "source.jsonl"), 8)
    model = train_bpe(corpus, os.path.join(out, "model"))
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    texts = [json.loads(line)["text"] for line in open(corpus)]
    chats, text = os.path.join(out, "chats.jsonl"), os.path.join(out, "text.jsonl")
    with open(chats, "w") as c, open(text, "w") as t:
        for i in range(n):
            source = texts[i % len(texts)]
            a, b = (i * 7) % 600, (i * 13) % 900
            messages = [
                {"role": "user", "content": source[a : a + 300]},
                {"role": "assistant", "content": source[b : b + 500]},
            ]
            c.write(json.dumps({"messages": messages}) + "\n")
            t.write(json.dumps({"text": tok.apply_chat_template(messages, tokenize=False)}) + "\n")
    return model, chats, text


def run(model: str, data: list[str], seq_len: int, out: str, name: str) -> dict:
    run_dir = os.path.join(out, name)
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), "model=pretrained", f"model.name_or_path={model}",
        *data, f"data.seq_len={seq_len}", f"data.store_dir={out}/stores", "data.eval_fraction=0", "logger=none",
        "trainer.max_steps=3", "trainer.eval_interval=0", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
        "checkpoint.interval=0", "checkpoint.export=false", "distributed.nproc_per_node=2", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    lines = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    ready = next(line for line in lines if "; ready in " in line)
    summary = next(
        json.loads(line)["summary"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"summary"' in line
    )
    return {"ready_s": float(ready.rsplit("ready in ", 1)[1].split()[0]), "rss": summary["peak_rss_gib"], "line": ready}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="bench_chat_")
    os.makedirs(out, exist_ok=True)
    model, chats, text = make(out, args.chats)
    cases = {
        "chat": ["data=chat", f"data.paths=[{chats}]"],
        "text": [f"data.paths=[{text}]", f"data.tokenizer={model}"],
    }
    print(f"{args.chats:,} conversations, data.seq_len={args.seq_len}, 2 ranks (this machine's cores shared)")
    print(f"{'data':<6}{'start':<8}{'ready s':>9}{'peak RSS GiB/rank':>19}")
    seconds = {}
    for name, data in cases.items():
        for start in ("first", "second"):
            r = run(model, data, args.seq_len, out, f"{name}_{start}")
            seconds[name, start] = r
            print(f"{name:<6}{start:<8}{r['ready_s']:>9.2f}{r['rss']:>19.3f}")
    print(seconds["chat", "second"]["line"].split("] ", 1)[-1])
    ratio = seconds["chat", "second"]["rss"] / seconds["text", "second"]["rss"]
    print(f"chat / text, second start: peak RSS per rank x{ratio:.3f}")


if __name__ == "__main__":
    main()
