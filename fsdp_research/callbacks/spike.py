"""Loss and gradient-norm spikes (as OLMo-core's stability monitor): each step's value against the mean and spread
of the last `window` steps' (the loss: its mean over ranks; the norm: the global one). A spike is logged as a
record (spike_loss_z, spike_grad_norm_z, spike_skipped); with skip, its optimizer step is skipped (OLMo-core's
SkipStepOptimizer), and spiking values stay out of the window. A non-finite value is a spike, and never enters it."""

import math
from collections import deque


class SpikeMonitor:
    def __init__(self, window: int = 100, threshold: float = 6.0, skip: bool = False, min_steps: int = 10):
        if window < 2 or min_steps < 2 or threshold <= 0:
            raise ValueError("window and min_steps must be at least 2, threshold above 0")
        self.window, self.threshold, self.skip, self.min_steps = window, threshold, skip, min_steps
        self.history = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}
        self.spikes = 0

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
        spiking = {
            key: z for key, z in scores.items() if z is not None and (z > self.threshold or not math.isfinite(z))
        }
        if spiking:
            self.spikes += 1
            if self.skip:
                run.skip_step()
            run.log(
                {
                    **{f"spike_{k}_z": round(z, 3) for k, z in scores.items() if z is not None and math.isfinite(z)},
                    "spike_skipped": self.skip,
                },
                step=step,
            )
            return
        for key in self.history:
            if math.isfinite(metrics[key]):  # an overflow the loss scaler skips stays out of the window
                self.history[key].append(float(metrics[key]))

    def state_dict(self) -> dict:
        return {"loss": list(self.history["loss"]), "grad_norm": list(self.history["grad_norm"]), "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        for key in self.history:
            self.history[key].clear()
            self.history[key].extend(state[key])
        self.spikes = state["spikes"]
