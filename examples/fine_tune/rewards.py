"""Reward functions for the GRPO walkthrough (docs/fine-tuning.md), with TRL's signature: any module of yours named by
its dotted path in objective.reward_funcs works so. The same functions go to TRL's GRPOTrainer in bench/grpo.py."""


def _text(completion) -> str:
    """A completion's text: as is, or a conversational one's assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def digits(prompts, completions, completion_ids=None, **columns) -> list[float]:
    """The share of the completion's characters that are digits (the answer's format: a number)."""
    return [sum(ch.isdigit() for ch in _text(c)) / max(1, len(_text(c))) for c in completions]


def correct(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float | None]:
    """1 where the completion, stripped, is the record's answer; None (not applicable) for a record without one."""
    answers = answer or [None] * len(completions)
    return [None if a is None else float(_text(c).strip() == str(a)) for c, a in zip(completions, answers)]
