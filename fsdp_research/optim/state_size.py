"""What an optimizer keeps per parameter, for the planner: fp32 copies of the parameter in its state (AdamW's two
moments, Muon's and Lion's one momentum, SGD's momentum if any); for an optimizer it does not know, AdamW's two,
said as assumed."""

from collections.abc import Mapping
from typing import Any

# By class name: copies, or a function of the optimizer's keyword arguments.
_COPIES = {
    "AdamW": 2,
    "Adam": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Muon": 1,
    "Lion": 1,
    "Adagrad": 1,
    "SGD": lambda kw: 1 if kw.get("momentum", 0) else 0,
    "RMSprop": lambda kw: 1 + bool(kw.get("momentum", 0)) + bool(kw.get("centered", False)),
    # Factored second moments: a row and a column vector per matrix, nothing per element.
    "Adafactor": 0,
}
ASSUMED = 2


def state_copies(target: str, kwargs: Mapping[str, Any]) -> tuple[float, bool]:
    """(fp32 copies of each parameter in the optimizer's state, whether it is known or assumed)."""
    known = _COPIES.get(str(target).rsplit(".", 1)[-1])
    if known is None:
        return ASSUMED, False
    return (known(kwargs) if callable(known) else known), True
