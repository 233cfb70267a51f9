"""Objectives: what training minimizes, a plug-in (objective._target_, like optim). An objective names the data it
reads, computes a micro-batch's loss from the model, says how many targets each sample holds (the trainer
normalizes by their sum over every rank and micro-batch), and its eval metrics. objective=lm, the default, is the
next-token loss (its settings: the loss group)."""

from fsdp_research.objectives.base import Objective, StepContext, build_objective, check_objective

__all__ = ["Objective", "StepContext", "build_objective", "check_objective"]
