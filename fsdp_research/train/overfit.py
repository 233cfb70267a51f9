"""data.overfit_batches' verdict: a model trained on the same few batches over and over should drive their loss
towards 0; one that does not has a bug in the model, the loss or the optimizer. Said once at the end of the run."""

import logging
from typing import Any

log = logging.getLogger("fsdp_research")

# The last logged loss at most this share of the first: the batches are fit.
FIT_SHARE = 0.1


def verdict(overfit_batches: int, losses: list[float]) -> dict[str, Any]:
    """Logs whether the logged losses fell below FIT_SHARE of the first; returns it for the run's summary
    ({} unless data.overfit_batches is on and two losses were logged)."""
    if not overfit_batches or len(losses) < 2:
        return {}
    first, last = losses[0], losses[-1]
    share = last / first if first > 0 else float("nan")
    fits = share <= FIT_SHARE
    said = (
        f"the model fits {overfit_batches} batch(es)"
        if fits
        else f"did not fall below {FIT_SHARE:.0%}: check the model, the loss and the optimizer (or train longer)"
    )
    log.info(f"overfit: loss {first:.4g} -> {last:.4g} ({share:.1%} of the first logged): {said}")
    return {"overfit_loss_share": round(share, 6), "overfit_fits": fits}
