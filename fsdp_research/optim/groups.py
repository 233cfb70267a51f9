"""Parameter groups: by name pattern (optim.param_groups, first match wins: its lr_scale, weight_decay and other
group keys), then decayed or not (optim.no_decay's kinds)."""

import fnmatch
import re
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from fsdp_research.errors import ConfigError

NO_DECAY = ("bias", "1d", "embedding")


def check_no_decay(kinds: list[str]) -> None:
    unknown = [kind for kind in kinds if kind not in NO_DECAY]
    if unknown:
        raise ConfigError(
            "optim.no_decay", f"unknown kind(s) {', '.join(map(repr, unknown))}", f"use some of {', '.join(NO_DECAY)}"
        )


def matches(pattern: str, name: str) -> bool:
    """A glob over the whole name (`*.bias`, `model.layers.*.mlp.*`) or a regular expression found in it
    (`embed|lm_head`)."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False


def check_patterns(entries: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    """Each optim.param_groups entry has a `match` that names at least one parameter."""
    for i, entry in enumerate(entries):
        key = f"optim.param_groups[{i}]"
        if not isinstance(entry, dict) or "match" not in entry:
            raise ConfigError(key, "has no `match`", "give each entry {match: <glob or regex>, lr_scale: ...}")
        if "lr" in entry:
            raise ConfigError(f"{key}.lr", "a group's rate follows the schedule from optim.lr", "use lr_scale")
        if not any(matches(str(entry["match"]), n) for n in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(
                f"{key}.match",
                f"{entry['match']!r} matches no parameter",
                f"use a glob or regex over the parameter names ({shown})",
            )


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay: Sequence[str],
    entries: Sequence[dict[str, Any]] = (),
    named: Sequence[tuple[str, nn.Parameter]] | None = None,
    lr: float | None = None,
) -> list[dict[str, Any]]:
    """The groups of `named` (name, parameter) pairs, by default all of the model's: for each pattern entry in
    order (then the unmatched), the decayed parameters (the entry's weight_decay, if it has one), then the others
    (the kinds in no_decay, weight decay 0). Each group has lr x its lr_scale (when lr is given) and the entry's
    other keys. Empty groups are left out."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    kinds = set(no_decay)
    named = list(model.named_parameters()) if named is None else list(named)

    def exempt(name: str, param: nn.Parameter) -> bool:
        return (
            ("bias" in kinds and name.endswith(".bias"))
            or ("1d" in kinds and param.ndim <= 1)
            or ("embedding" in kinds and id(param) in tables)
        )

    def entry_of(name: str) -> int:
        return next((i for i, e in enumerate(entries) if matches(str(e["match"]), name)), len(entries))

    groups = []
    for index, entry in enumerate([*entries, {}]):
        mine = [(n, p) for n, p in named if entry_of(n) == index]
        extra = {k: v for k, v in entry.items() if k not in ("match", "lr_scale", "weight_decay")}
        scale = float(entry.get("lr_scale", 1.0))
        for skip in (False, True):
            params = [p for n, p in mine if exempt(n, p) == skip]
            decay = 0.0 if skip else entry.get("weight_decay", weight_decay)
            group = {"params": params, "weight_decay": decay, **extra}
            if lr is not None:
                group["lr"] = lr * scale
            groups.append(group)
    return [group for group in groups if group["params"]]
