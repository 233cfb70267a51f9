"""objective.reward_funcs: the user's reward functions, each a dotted name or {_target_: <name>, <its keyword
arguments>}, called as TRL's GRPOTrainer calls them: func(prompts=, completions=, completion_ids=, **columns), the
columns each record's other fields as lists, one entry per completion; each returns a float, or None where it does
not apply, per completion. One that raises, or returns the wrong count or a non-number, stops the run with one line
naming it and the prompt's index (every rank stops: the ranks agree on it)."""

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp_research.config.targets import check_call, kwargs_of, resolve
from fsdp_research.errors import ConfigError, RewardError

KEY = "objective.reward_funcs"


def build_rewards(given: list, weights: list | None) -> tuple[list[str], list[Callable], torch.Tensor]:
    """(names, functions, weights [functions]) of objective.reward_funcs and reward_weights (None: 1 each), checked
    before any compute."""
    if not given:
        raise ConfigError(KEY, "is empty: GRPO learns from rewards", "name a function: [my_pkg.rewards.correct]")
    names, funcs = [], []
    for i, entry in enumerate(given):
        key = f"{KEY}[{i}]"
        path = entry.get("_target_") if isinstance(entry, dict) else entry
        if not isinstance(path, str):
            raise ConfigError(key, f"{entry!r} names no function", "give a dotted name, or {_target_: <name>, ...}")
        func, kwargs = resolve(path, key), kwargs_of(entry) if isinstance(entry, dict) else {}
        if not callable(func):
            raise ConfigError(key, f"{path} is not callable", "name a function")
        check_call(func, kwargs, f"{key}._target_")
        names.append(path.rsplit(".", 1)[-1])
        funcs.append(functools.partial(func, **kwargs) if kwargs else func)
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(
            "objective.reward_weights", f"{len(weights)} weights for {len(funcs)} functions", "give one each"
        )
    return names, funcs, torch.tensor([1.0] * len(funcs) if weights is None else [float(w) for w in weights])


def _checked(name: str, values: Any, n: int, prompt_of: list[int]) -> list[float]:
    """A function's values as floats (None: NaN), or a RewardError naming the first wrong one's prompt."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        size = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward function {name} returned {size} values for {n} completions (prompt {prompt_of[0]}"
                          " first): return one float or None per completion")  # fmt: skip
    out = []
    for k, v in enumerate(values):
        if v is not None and not isinstance(v, numbers.Real):  # bools too, as TRL takes them
            raise RewardError(
                f"reward function {name} returned {v!r} for a completion of prompt {prompt_of[k]}: not a number"
            )
        out.append(math.nan if v is None else float(v))
    return out


def score(
    names: list[str], funcs: list[Callable], columns: dict[str, list], prompt_of: list[int]
) -> tuple[torch.Tensor, str | None]:
    """([completions, functions] rewards, NaN where not applicable; the error, None if none) of this rank's
    completions, `columns` holding prompts, completions, completion_ids and the records' other fields."""
    n = len(prompt_of)
    out = torch.full((n, len(funcs)), math.nan, dtype=torch.float64)
    try:
        for j, (name, func) in enumerate(zip(names, funcs)):
            try:
                values = func(**columns)
            except Exception as err:
                raise RewardError(
                    f"reward function {name} raised {type(err).__name__}: {err} (its first prompt: data index "
                    f"{prompt_of[0]})"
                ) from None
            out[:, j] = torch.tensor(_checked(name, values, n, prompt_of), dtype=torch.float64)
    except RewardError as err:
        return out, str(err).splitlines()[0]
    return out, None


def agree_on_errors(error: str | None) -> None:
    """Every rank raises the first rank's reward error, if any rank met one (a collective)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise RewardError(first)


def reward_columns(
    records: list[dict], field: str, fields, ids: list[list[int]], texts: list[str], conversational: bool
) -> dict[str, list]:
    """The reward functions' arguments (TRL's) for completions of the records' prompts: prompts as given,
    completions (text, or an assistant message for conversational prompts), completion_ids, and every other field
    of the records."""
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {"prompts": [r[field] for r in records], "completions": completions, "completion_ids": ids}
    for name in fields:
        if name != field:
            columns[name] = [r.get(name) for r in records]
    return columns


def text_of(value) -> str:
    """A prompt or completion as text: itself, or its messages' last one's content."""
    return value if isinstance(value, str) else value[-1]["content"]
