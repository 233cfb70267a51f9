"""The errors a user sees as one line: what is wrong, where, and the fix. A leaf: imports nothing of ours."""


class ConfigError(ValueError):
    """A bad config value: the message names the key and the fix, on one line."""

    def __init__(self, key: str, problem: str, fix: str):
        super().__init__(f"{key}: {problem}; fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix

    def __reduce__(self):
        # Pickled whole (one rank's error raised on all of them): the default would call __init__ with the message.
        return type(self), (self.key, self.problem, self.fix)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit the run: one line, what and where."""


class SubmitError(Exception):
    """Why nothing was submitted to SLURM, in one line."""


class DataError(RuntimeError):
    """A token store cannot be built or read: one line, what and where."""


class CallbackError(RuntimeError):
    """A callback raised: which one, in which hook, and its error, in one line."""


class AnomalyError(RuntimeError):
    """A non-finite value under trainer.detect_anomaly: the step and where it first appeared, in one line."""


class RewardError(RuntimeError):
    """A reward function raised or returned what is no reward: which one, for which prompt, in one line."""
