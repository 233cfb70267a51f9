"""Loss and gradient-norm spikes (as OLMo-core's stability monitor): each step's value against the mean and spread
of the last `window` steps' (the loss: its mean over ranks; the norm: the global one). A spike is logged as a
record (spike_loss_z, spike_grad_norm_z, spike_skipped); with skip, its optimizer step is skipped (OLMo-core's
SkipStepOptimizer). Every finite value enters the window, spike or not (OLMo-core's rule): after a lasting level
shift (a data-mix change, the end of warmup) the window follows it, where keeping spikes out would skip every later
step. A run of skips is capped at max_consecutive_skips: the next spike is taken, and the log says why. A non-finite
value is a spike, never enters the window, and is skipped however many came before."""

import logging
import math
from collections import deque

log = logging.getLogger("fsdp_research")


class SpikeMonitor:
    def __init__(
        self,
        window: int = 100,
        threshold: float = 6.0,
        skip: bool = False,
        min_steps: int = 10,
        max_consecutive_skips: int = 5,
    ):
        if window < 2 or min_steps < 2 or threshold <= 0:
            raise ValueError("window and min_steps must be at least 2, threshold above 0")
        if max_consecutive_skips < 0:
            raise ValueError("max_consecutive_skips must be 0 or more")
        self.window, self.threshold, self.skip, self.min_steps = window, threshold, skip, min_steps
        self.max_consecutive_skips = max_consecutive_skips
        self.history = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.spikes = 0
        self.consecutive_skips = 0

    def _z(self, key: str, value: float) -> float | None:
        if not math.isfinite(value):
            return math.inf
        past = self.history[key]
        if len(past) < self.min_steps:
            return None
        mean = sum(past) / len(past)
        std = math.sqrt(sum((v - mean) ** 2 for v in past) / (len(past) - 1))
        return (value - mean) / max(std, 1e-12)

    def on_before_optimizer_step(self, run, step: int, metrics: dict) -> None:
        scores = {key: self._z(key, metrics[key]) for key in self.history}
        for key in self.history:
            if math.isfinite(metrics[key]):  # an overflow the loss scaler skips stays out of the window
                self.history[key].append(float(metrics[key]))
        spiking = any(z is not None and (z > self.threshold or not math.isfinite(z)) for z in scores.values())
        if not spiking:
            self.consecutive_skips = 0
            return
        self.spikes += 1
        # A non-finite value is always skipped: taking it would put nan in the weights for good.
        finite_values = all(math.isfinite(metrics[key]) for key in self.history)
        skipped = self.skip and (self.consecutive_skips < self.max_consecutive_skips or not finite_values)
        if skipped:
            self.consecutive_skips += 1
            run.skip_step()
        elif self.skip:
            log.warning(
                f"spike at step {step} not skipped: {self.consecutive_skips} steps in a row were "
                f"(callbacks.spike.max_consecutive_skips={self.max_consecutive_skips}); a lasting shift, not a spike?"
            )
            self.consecutive_skips = 0
        finite = {f"spike_{k}_z": round(z, 3) for k, z in scores.items() if z is not None and math.isfinite(z)}
        run.log({**finite, "spike_skipped": skipped}, step=step)

    def state_dict(self) -> dict:
        return {
            "loss": list(self.history["loss"]),
            "grad_norm": list(self.history["grad_norm"]),
            "spikes": self.spikes,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in self.history:
            self.history[key].clear()
            self.history[key].extend(state[key])
        self.spikes = state["spikes"]
        self.consecutive_skips = state.get("consecutive_skips", 0)
