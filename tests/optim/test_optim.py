"""Weight decay groups as optim.no_decay names them, against the groups written out from transformers' own model
(tests/helpers/reference.py); the correctness suite then trains with the default groups against torch's AdamW."""

import pytest
from transformers import AutoModelForCausalLM

from fsdp_research.config.schema import typed
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.optim import check_optim, param_groups
from tests.helpers.reference import decay_groups
from tests.helpers.zoo import hf_config

pytestmark = pytest.mark.distributed


def groups_of(model, o):
    return param_groups(model, o.weight_decay, o.no_decay)


def _names(model, groups) -> list[tuple[float, set[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in groups if g["params"]]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("no_decay", [[], ["bias"], ["1d"], ["bias", "1d"], ["bias", "1d", "embedding"]])
def test_decay_groups_as_configured(family, no_decay):
    model = AutoModelForCausalLM.from_config(hf_config(family, tie_word_embeddings=family == "gpt2"))
    o = typed(compose([f"optim.no_decay=[{','.join(no_decay)}]"])).optim
    if family == "gpt2" and "embedding" in no_decay:  # its position table is an embedding too
        assert {"transformer.wpe.weight", "transformer.wte.weight"} <= _names(model, groups_of(model, o))[-1][1]
        return
    assert _names(model, groups_of(model, o)) == _names(model, decay_groups(model, o))


def test_norms_and_biases_are_not_decayed_by_default():
    model = AutoModelForCausalLM.from_config(hf_config("gpt2"))
    decayed, exempt = _names(model, groups_of(model, typed(compose([])).optim))
    assert decayed[0] == 0.1 and exempt[0] == 0.0
    assert "transformer.h.0.ln_1.weight" in exempt[1] and "transformer.h.0.attn.c_attn.bias" in exempt[1]
    assert "transformer.h.0.attn.c_attn.weight" in decayed[1] and "transformer.wte.weight" in decayed[1]


def test_an_unknown_kind_is_named():
    cfg = typed(compose(["optim.no_decay=[norms]"]))
    with pytest.raises(ConfigError, match=r"optim.no_decay: unknown kind\(s\) 'norms'.*use some of bias, 1d"):
        check_optim(cfg.optim, cfg.schedule)


def _resume_groups(checkpoint_cfg, saved_cfg, resumed_cfg, run_dir: str) -> list[float]:
    """A checkpoint written with one weight decay, resumed under a config with another: the groups' decays after
    the load."""
    import torch
    import torch.nn as nn

    from fsdp_research.checkpoint.dcp import Checkpointer
    from fsdp_research.checkpoint.resume import load_checkpoint
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.optim import build_optimizer

    init_distributed(typed(compose([])).distributed, torch.device("cpu"))
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    saved, _ = build_optimizer(model, saved_cfg)
    model(torch.ones(2, 4)).sum().backward()
    saved.step()
    model.zero_grad(set_to_none=True)  # as at a resume: no gradients, so DCP makes the state to load into
    checkpointer = Checkpointer(checkpoint_cfg, run_dir, {})
    checkpointer.save(1, model, saved, {"step": 1})
    optimizer, _ = build_optimizer(model, resumed_cfg)
    load_checkpoint(f"{run_dir}/checkpoints/step_1", model, optimizer)
    return [group["weight_decay"] for group in optimizer.param_groups]


def test_resume_takes_the_configured_decay(tmp_path):
    from tests.helpers.dist import run_distributed

    saved, resumed = typed(compose(["optim.weight_decay=0.5"])), typed(compose([]))
    decays = run_distributed(_resume_groups, 1, resumed.checkpoint, saved, resumed, str(tmp_path))
    assert decays == [0.1, 0.0]  # the checkpoint's 0.5 without the config winning
