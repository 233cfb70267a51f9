"""A tiny fine-tuning setup made here, offline: chats in JSON Lines (train and eval), preference pairs of the same sums
(pairs_train, pairs_eval: the right answer chosen, a wrong one rejected), prompts of the same sums with their answers
for GRPO (prompts_train: TRL's prompt-only format, the answer a column for the reward functions), a byte-level BPE
tokenizer with ChatML's turn tokens and chat template, and a small llama beside it written with save_pretrained
(random weights: it stands in for the pretrained model you would name).

    python examples/fine_tune/make_data.py <out dir> [--hidden 128] [--layers 4] [--chats 2000]"""

import argparse
import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chats(n: int, seed: int) -> list[dict]:
    """Sums asked and answered: a task a small model learns in a few hundred steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer with the number."},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return out


def pairs(n: int, seed: int) -> list[dict]:
    """TRL's conversational preference format: the sum asked, the right answer chosen, one off by 1 to 3 rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, off = rng.randint(0, 20), rng.randint(0, 20), rng.choice([-3, -2, -1, 1, 2, 3])
        prompt = [
            {"role": "system", "content": "Answer with the number."},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
        answer = [{"role": "assistant", "content": str(a + b)}], [{"role": "assistant", "content": str(a + b + off)}]
        out.append({"prompt": prompt, "chosen": answer[0], "rejected": answer[1]})
    return out


def prompts(n: int, seed: int) -> list[dict]:
    """TRL's prompt-only conversational format: the sum asked, its answer a column the reward functions read."""
    return [{"prompt": c["messages"][:2], "answer": c["messages"][2]["content"]} for c in chats(n, seed)]


def main(out: str, hidden: int = 128, layers: int = 4, n_chats: int = 2000) -> None:
    os.makedirs(out, exist_ok=True)
    train, evals = chats(n_chats, 0), chats(100, 1)
    both = (
        ("train", train),
        ("eval", evals),
        ("pairs_train", pairs(n_chats, 2)),
        ("pairs_eval", pairs(100, 3)),
        ("prompts_train", prompts(n_chats, 4)),
    )
    for name, rows in both:
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    texts = [m["content"] for row in train for m in row["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    model_dir = os.path.join(out, "model")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=specials[0], pad_token=specials[0], additional_special_tokens=specials[1:]
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(model_dir)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights on every machine: the walkthrough's figures reproduce
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    written = ", ".join(f"{out}/{name}.jsonl" for name, _ in both)
    print(f"wrote {written} and {model_dir} (tokenizer with a chat template, llama)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="examples/fine_tune/out")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chats", type=int, default=2000)
    args = parser.parse_args()
    main(args.out, args.hidden, args.layers, args.chats)
