"""Several optimizers over disjoint parameters as one torch Optimizer (Muon for the block matrices, AdamW for the
rest): one step, one zero_grad, one state dict for DCP, one schedule over every group."""

from typing import Any

import torch


class Combined(torch.optim.Optimizer):
    """The parts' parameter groups (the same dicts) in order; one state, keyed by parameter, that every part
    reads and writes. A load replaces both (torch's load_state_dict builds new ones): the parts are pointed at the
    new ones before each step."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([group for part in parts for group in part.param_groups], {})
        self._link()

    def _link(self) -> None:
        start = 0
        for part in self.parts:
            count = len(part.param_groups)
            part.param_groups = self.param_groups[start : start + count]
            part.state = self.state
            start += count

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        self._link()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def __repr__(self) -> str:
        return f"Combined({', '.join(type(p).__name__ for p in self.parts)})"
