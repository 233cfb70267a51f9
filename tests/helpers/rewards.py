"""Reward functions as a user's package has them (TRL's signature), for objective=grpo's tests."""


def _text(completion) -> str:
    """A completion's text: as is, or a conversational one's assistant message."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def digits(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of the completion's characters that are digits: a random model's completions differ in it."""
    return [sum(ch.isdigit() for ch in _text(c)) / max(1, len(_text(c))) for c in completions]


def mean_token(prompts, completions, completion_ids, **columns) -> list[float]:
    """The completion's mean token id: any token sampled otherwise moves it (a check of which noise sampled them)."""
    return [sum(ids) / max(1, len(ids)) for ids in completion_ids]


def matches_answer(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """1 where the completion holds the record's answer, 0 where not; None (not applicable) without one."""
    return [None if a is None else float(str(a) in _text(c)) for c, a in zip(completions, answer)]


_CALLS = []


def raises_second_time(prompts, completions, completion_ids, **columns) -> list[float]:
    """digits' on its first call in a process; then it raises (a run's second step, on every rank)."""
    _CALLS.append(1)
    if len(_CALLS) > 1:
        raise ValueError("this reward function fails")
    return digits(prompts, completions, completion_ids)


def too_few(prompts, completions, completion_ids, **columns) -> list[float]:
    return [0.0] * (len(completions) - 1)
