"""Conversations as users have them, and a chat tokenizer trained here: a byte-level BPE with ChatML's turn tokens
and a ChatML template, with or without transformers' {% generation %} marks around the assistant's turns."""

import json
import os

from tests.helpers.corpora import bpe_tokenizer

_TURN = "<|im_start|>{{ m['role'] }}\n"
_END = "{{ m['content'] }}<|im_end|>\n"
_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
CHATML = "{% for m in messages %}" + _TURN + _END + "{% endfor %}" + _PROMPT
CHATML_MARKED = (
    "{% for m in messages %}" + _TURN
    + "{% if m['role'] == 'assistant' %}{% generation %}" + _END + "{% endgeneration %}{% else %}" + _END
    + "{% endif %}{% endfor %}" + _PROMPT
)  # fmt: skip

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is x + 1 when x is 2?"},
        {"role": "assistant", "content": "It is 3."},
    ],
    [
        {"role": "user", "content": "def f(x): return what?"},
        {"role": "assistant", "content": "return x + 1"},
        {"role": "user", "content": "and the class?"},
        {"role": "assistant", "content": "class A:\n    pass"},
    ],
    [
        {"role": "user", "content": "import os?"},
        {"role": "assistant", "content": "import os\nimport sys"},
    ],
]


def chat_tokenizer(out_dir: str, template: str = CHATML) -> str:
    """bpe_tokenizer's, with <|im_start|> and <|im_end|> and the template; saved with save_pretrained."""
    from transformers import AutoTokenizer

    bpe_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    tok.save_pretrained(out_dir)
    return out_dir


def chat_llama(out_dir: str, template: str = CHATML) -> str:
    """chat_tokenizer's, and beside it a tiny llama of its vocabulary (from_config, seed 0), by save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.zoo import hf_config

    chat_tokenizer(out_dir, template)
    torch.manual_seed(0)
    vocab = len(AutoTokenizer.from_pretrained(out_dir))
    AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=vocab)).save_pretrained(out_dir)
    return out_dir


def write_chats(path: str, conversations=CONVERSATIONS, field: str = "messages") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for messages in conversations:
            f.write(json.dumps({field: messages}) + "\n")
    return path
