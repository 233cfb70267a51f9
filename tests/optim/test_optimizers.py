"""Optimizers and parameter groups as the config names them (any `_target_`, Muon beside AdamW), checked against
formulas written out here and torch's own classes."""

import pytest
import torch

from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.optim import build_optimizer, check_optim, param_groups
from fsdp_research.optim.combined import Combined
from fsdp_research.optim.muon import Muon
from fsdp_research.train.refusals import check_config
from tests.helpers.zoo import tiny_llama


def _names(model, groups):
    names = {id(p): n for n, p in model.named_parameters()}
    return [({k: v for k, v in g.items() if k != "params"}, {names[id(p)] for p in g["params"]}) for g in groups]


def test_param_groups_by_pattern_first_match_wins():
    model = tiny_llama()
    entries = [
        {"match": "*embed_tokens*", "lr_scale": 0.5, "weight_decay": 0.0},
        {"match": r"lm_head|norm", "lr_scale": 2.0, "betas": [0.8, 0.9]},  # a regex; the embedding is taken above
    ]
    groups = _names(model, param_groups(model, 0.1, ["1d"], entries, lr=1e-3))
    embed, head_decayed, head_exempt, rest_decayed = groups  # llama has no vector outside the norms
    assert embed == ({"weight_decay": 0.0, "lr": 5e-4}, {"model.embed_tokens.weight"})
    assert head_decayed == ({"weight_decay": 0.1, "betas": [0.8, 0.9], "lr": 2e-3}, {"lm_head.weight"})
    assert head_exempt[0] == {"weight_decay": 0.0, "betas": [0.8, 0.9], "lr": 2e-3}
    assert head_exempt[1] == {n for n, p in model.named_parameters() if "norm" in n}
    assert rest_decayed[0] == {"weight_decay": 0.1, "lr": 1e-3}
    assert rest_decayed[1] == {n for n, p in model.named_parameters() if p.ndim == 2} - {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    # An entry's weight decay is for what it decays: no_decay's kinds keep 0.
    groups = _names(model, param_groups(model, 0.1, ["1d"], [{"match": "model.layers.0.*", "weight_decay": 0.5}]))
    assert [g[0]["weight_decay"] for g in groups] == [0.5, 0.0, 0.1, 0.0]
    assert all(n.endswith("layernorm.weight") for n in groups[1][1])


@pytest.mark.parametrize(
    "option, kinds",
    [("adamw", [torch.optim.AdamW]), ("sgd", [torch.optim.SGD]), ("adafactor", [torch.optim.Adafactor])],
)
def test_shipped_optimizers_are_torchs(option, kinds):
    optimizer, scheduler = build_optimizer(tiny_llama(), compose([f"optim={option}"]))
    assert [type(optimizer)] == kinds
    assert scheduler.get_last_lr()[0] == pytest.approx(optimizer.defaults["lr"] / 10)  # first warmup step


def test_muon_takes_the_block_matrices_adamw_the_rest():
    model = tiny_llama()
    cfg = compose(["optim=muon", "optim.param_groups=[{match: '*embed_tokens*', lr_scale: 0.1}]"])
    optimizer, _ = build_optimizer(model, cfg, [f"model.layers.{i}" for i in range(len(model.model.layers))])
    assert isinstance(optimizer, Combined) and [type(p) for p in optimizer.parts] == [Muon, torch.optim.AdamW]
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.parts[0].param_groups for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if n.startswith("model.layers.") and p.ndim == 2}
    lrs = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lrs["model.embed_tokens.weight"] == pytest.approx(3e-4 / 10)  # others.lr x 0.1 x the first warmup step
    assert lrs["model.layers.0.mlp.up_proj.weight"] == pytest.approx(0.02 / 10)


def test_an_optimizer_without_weight_decay_or_lr_scale_keys():
    # torch's Rprop takes no weight_decay: the framework's per-group keys are not forced on it.
    cfg = compose(["optim._target_=torch.optim.Rprop", "~optim.betas", "~optim.eps", "+optim.etas=[0.4,1.3]"])
    check_optim(cfg.optim, cfg.schedule)
    optimizer, _ = build_optimizer(tiny_llama(), cfg)
    assert type(optimizer) is torch.optim.Rprop and optimizer.defaults["etas"] == [0.4, 1.3]


def test_a_users_optimizer_class_and_kwargs():
    optimizer, _ = build_optimizer(
        tiny_llama(), compose(["optim._target_=torch.optim.RMSprop", "~optim.betas", "~optim.eps", "+optim.alpha=0.9"])
    )
    assert type(optimizer) is torch.optim.RMSprop and optimizer.defaults["alpha"] == 0.9


BAD = {
    "not_importable": (["optim._target_=mypkg.opt.Lion"], "optim._target_: cannot import 'mypkg.opt.Lion'"),
    "no_attribute": (
        ["optim._target_=torch.optim.Lion"],
        "optim._target_: module 'torch.optim' has no attribute 'Lion'",
    ),
    "bad_kwarg": (["optim.betass=[0.9,0.9]"], "optim.betass: AdamW takes no argument 'betass'"),
    "others_kwarg": (["optim=muon", "optim.others.momentum=0.9"], "optim.others.momentum: AdamW takes no argument"),
    "schedule_name": (["schedule.name=cosin"], "schedule.name: unknown schedule 'cosin'"),
    "schedule_key": (["+schedule.decay=0.1"], "schedule.decay: the cosine schedule has no key 'decay'"),
    "schedule_fn": (["schedule._target_=math.sqrt"], "schedule._target_: sqrt"),
    "loss_key": (["+loss.z_los=1e-4"], "loss.z_los: cross_entropy has no key 'z_los'"),
    "loss_target": (["loss._target_=torch.nn.functional.nope"], "loss._target_: module 'torch.nn.functional'"),
    "loss_unused": (
        ["loss._target_=torch.nn.functional.nll_loss", "loss.z_loss=1e-4"],
        "loss.z_loss: torch.nn.functional.nll_loss does not take it",
    ),
    "others_lr": (["optim=muon", "~optim.others.lr"], "optim.others.lr: is not set"),
    "callback_target": (["+callbacks.mine._target_=no.such.Callback"], "callbacks.mine._target_: cannot import"),
    "callback_kwarg": (["callbacks=spike", "+callbacks.spike.windw=3"], "callbacks.spike.windw: SpikeMonitor takes"),
    "callback_hooks": (
        ["+callbacks.x._target_=collections.OrderedDict"],
        "callbacks.x._target_: collections.OrderedDict has none of the hooks",
    ),
    "adafactor_sharded": (["optim=adafactor"], "optim: torch.optim.Adafactor cannot step FSDP2's row shards"),
    "model_mixed": (["model._target_=torch.nn.Linear"], "model._target_: is set together with model.model_type"),
    "model_key_typo": (["+model.nme=x"], "model.nme: is not a key of a transformers model"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_plugin_config_is_one_line_naming_the_key(name):
    overrides, message = BAD[name]
    cfg = compose(overrides)
    from fsdp_research.model.architecture import build_hf_config

    with pytest.raises(ConfigError) as err:
        check_config(cfg, 2, build_hf_config(cfg.model), torch.device("cpu"))
    text = str(err.value)
    assert text.startswith(message) and "; fix: " in text and "\n" not in text, text


def test_callbacks_are_added_and_removed_from_the_command_line():
    cfg = compose(
        ["callbacks=[spike,ema]", "~callbacks.spike", "+callbacks.mine._target_=tests.helpers.plugins.Recorder"]
    )
    assert list(cfg.callbacks) == ["ema", "mine"]


def test_a_param_group_matching_nothing_is_refused_once_the_model_is_planned():
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.train.refusals import checked_plan

    cfg = compose(["optim.param_groups=[{match: nothing_here, lr_scale: 2}]"])
    with pytest.raises(ConfigError, match=r"^optim.param_groups\[0\].match: 'nothing_here' matches no parameter"):
        checked_plan(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))
    cfg = compose(["optim.param_groups=[{match: '*norm*', lr: 1e-3}]"])
    with pytest.raises(ConfigError, match=r"^optim.param_groups\[0\].lr: .*; fix: use lr_scale"):
        checked_plan(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))
