"""A callback of one's own: stops the run once the loss (the mean over ranks) is below `target`, and notes the
step it stopped at (rank 0 alone writes the file)."""

import os


class StopAtLoss:
    def __init__(self, target: float):
        self.target = target

    def on_step_end(self, run, step: int, metrics: dict) -> None:
        if metrics["loss"] < self.target:
            run.request_stop()
            run.log({"stop_at_loss": metrics["loss"]})
            if run.rank == 0:
                with open(os.path.join(run.run_dir, "stopped_at.txt"), "w") as f:
                    f.write(f"{step}\n")
