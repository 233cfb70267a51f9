"""Experiment presets compose as `@package _global_` overrides of the groups."""

import pytest

from fsdp_research.config.schema import Strategy
from fsdp_research.jobs.compose import compose


def test_experiment_preset_overrides_groups():
    cfg = compose(["experiment=llama_7b_8gpu"])
    assert cfg.model.name == "llama_7b" and cfg.model.config.hidden_size == 4096
    assert cfg.sharding.strategy is Strategy.blockwise and cfg.precision.name == "bf16"
    assert cfg.activation_checkpointing.stride == 1
    assert (cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size, cfg.data.seq_len) == (64, 8, 2048)
    assert cfg.distributed.nproc_per_node == 8 and cfg.checkpoint["async"] is True


def test_command_line_overrides_the_preset():
    assert compose(["experiment=llama_7b_8gpu", "distributed.nproc_per_node=4"]).distributed.nproc_per_node == 4


def test_deprecated_names_are_read_with_a_warning():
    """trainer.objective became trainer.sweep_metric (objective is now the group of what training minimizes)."""
    with pytest.warns(FutureWarning, match="trainer.objective is deprecated: use trainer.sweep_metric"):
        cfg = compose(["trainer.objective=tokens_per_s"])
    assert cfg.trainer.sweep_metric == "tokens_per_s" and cfg.trainer.objective is None
    assert compose([]).objective._target_ == "fsdp_research.objectives.lm.NextToken"
    # The new name, set, wins (an old hparams_search file may still set the old one).
    both = compose(["trainer.objective=eval_loss", "trainer.sweep_metric=tokens_per_s"])
    assert both.trainer.sweep_metric == "tokens_per_s"
