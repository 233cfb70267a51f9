"""What a run carries besides the model and the optimizer: the state a resume restores, and what train() returns."""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from fsdp_research.distributed.precision import LossScaler
from fsdp_research.errors import ConfigError
from fsdp_research.metrics.sinks import new_run_id


@dataclass
class TrainState:
    """What a resume restores besides the model, the optimizer and each rank's RNG (the checkpointer's)."""

    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    step: int = 0
    # The samples (windows) trained on: where the data goes on, whatever the global batch size of each step was.
    samples: int = 0
    tokens_seen: int = 0
    wandb_run_id: str = field(default_factory=new_run_id)
    # LoRA: what identifies the frozen base the adapters train on (fsdp_research.model.lora.base_identity).
    base_weights: str | None = None

    def state_dict(self, world_size: int) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples": self.samples,
            "tokens_seen": self.tokens_seen,
            "wandb_run_id": self.wandb_run_id,
            "world_size": world_size,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "base_weights": self.base_weights,
        }

    def load_state_dict(self, state: dict[str, Any], seq_len: int) -> None:
        """`seq_len`: the run's window, which counts the samples of a checkpoint from before they were kept."""
        if state.get("base_weights") != self.base_weights:
            raise ConfigError(
                "model.name_or_path",
                "is not the base the checkpoint's adapters trained on"
                if self.base_weights and state.get("base_weights")
                else "the checkpoint is of a run with LoRA and this one without, or the other way round",
                "resume with the run's own model settings",
            )
        self.step, self.tokens_seen, self.wandb_run_id = state["step"], state["tokens_seen"], state["wandb_run_id"]
        self.samples = state.get("samples", self.tokens_seen // seq_len)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])


@dataclass
class TrainResult:
    model: nn.Module
    losses: list[float] = field(default_factory=list)
    # Stopped early by a signal, after saving a resume checkpoint: preemption's STOP or REQUEUE code.
    stop: int = 0
    # Why the stop saved no checkpoint: it would have ended past trainer.preemption_grace_s.
    past_grace: str | None = None
    # A signal this rank caught, even after the loop (then the run completes, and a sweep stops after it).
    signal: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def preempted(self) -> bool:
        return bool(self.stop)
