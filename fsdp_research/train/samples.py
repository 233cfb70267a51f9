"""Samples while training (trainer.sample_prompts): at each eval, each prompt continued greedily by the model as it
is now, the first thing one reads after a fine-tune. Every rank runs the forwards (FSDP's are collectives) and takes
rank 0's next token, so all extend alike."""

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from fsdp_research.data.chat import chat_tokenizer, end_of_turn, prompt_rendering
from fsdp_research.data.tokenizer import load_tokenizer
from fsdp_research.errors import ConfigError


def sample_prompts(t: DictConfig) -> list[str]:
    """trainer.sample_prompts: a list, or a text file of one prompt per line."""
    given = t.sample_prompts
    if not given:
        return []
    if isinstance(given, str):
        if not os.path.isfile(given):
            raise ConfigError("trainer.sample_prompts", f"{given} is no file", "give a list, or a file of prompts")
        with open(given) as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    return [str(p) for p in given]


def check_samples(cfg: DictConfig) -> None:
    prompts = sample_prompts(cfg.trainer)
    if prompts and not cfg.trainer.eval_interval:
        raise ConfigError("trainer.sample_prompts", "are sampled at each eval, but eval is off", "set eval_interval")
    if cfg.trainer.sample_tokens < 1:
        raise ConfigError("trainer.sample_tokens", f"{cfg.trainer.sample_tokens} is below 1", "use e.g. 32")


def _encoder(cfg: DictConfig) -> tuple[Callable[[str], list[int]], set[int]]:
    """(a prompt's ids, the ids a sample stops at). Conversations: the prompt as a user's message after the chat
    template's generation prompt, stopping at the end of the document or of the assistant's turn; prompt/completion
    pairs: as the pair's prompt is tokenized; text: its tokens, stopping at the end of the document."""
    base = load_tokenizer(cfg.data.tokenizer)
    eos = base.eos_id
    rendering = prompt_rendering(cfg.data)
    if rendering == "text":
        return base.prompt_ids, {eos}
    tok = chat_tokenizer(cfg.data)
    if rendering == "pair":
        return lambda prompt: tok(prompt)["input_ids"], {eos}

    def encode(prompt: str) -> list[int]:
        message = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    return encode, {eos} | ({end_of_turn(tok)} - {None})


@torch.no_grad()
def greedy(model: nn.Module, ids: list[int], tokens: int, device: torch.device, amp, stop: set[int]) -> list[int]:
    """`tokens` more ids (fewer at a stop token), each the argmax of the whole sequence's forward (no cache: a few
    short samples per eval). A collective: every rank calls it."""
    x = torch.tensor([ids], device=device)
    out: list[int] = []
    for _ in range(tokens):
        with amp:
            nxt = model(input_ids=x).logits[:, -1].argmax(-1)
        dist.broadcast(nxt, src=0)
        out.append(int(nxt.item()))
        if out[-1] in stop:
            break
        x = torch.cat([x, nxt[:, None]], dim=1)
    return out


def take_samples(model: nn.Module, cfg: DictConfig, device: torch.device, amp) -> list[dict[str, str]]:
    """Each prompt and its continuation (as long as data.seq_len allows); the model back in training mode."""
    prompts = sample_prompts(cfg.trainer)
    if not prompts:
        return []
    tok = load_tokenizer(cfg.data.tokenizer)
    encode, stop = _encoder(cfg)
    rows = []
    model.eval()
    for prompt in prompts:
        ids = encode(prompt)[-cfg.data.seq_len + 1 :]
        room = min(cfg.trainer.sample_tokens, cfg.data.seq_len - len(ids))
        rows.append({"prompt": prompt, "completion": tok.decode(greedy(model, ids, room, device, amp, stop))})
    model.train()
    return rows
