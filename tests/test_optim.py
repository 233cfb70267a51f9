"""Weight decay groups as optim.no_decay names them, against the groups written out from transformers' own model
(tests/helpers/reference.py); the correctness suite then trains with the default groups against torch's AdamW."""

import pytest
from transformers import AutoModelForCausalLM

from fsdp_research.composition import compose
from fsdp_research.config import typed
from fsdp_research.errors import ConfigError
from fsdp_research.optim import param_groups
from fsdp_research.validation import check_optim
from tests.helpers.reference import decay_groups
from tests.helpers.zoo import hf_config


def _names(model, groups) -> list[tuple[float, set[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in groups if g["params"]]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
@pytest.mark.parametrize("no_decay", [[], ["bias"], ["1d"], ["bias", "1d"], ["bias", "1d", "embedding"]])
def test_decay_groups_as_configured(family, no_decay):
    model = AutoModelForCausalLM.from_config(hf_config(family, tie_word_embeddings=family == "gpt2"))
    o = typed(compose([f"optim.no_decay=[{','.join(no_decay)}]"])).optim
    if family == "gpt2" and "embedding" in no_decay:  # its position table is an embedding too
        assert {"transformer.wpe.weight", "transformer.wte.weight"} <= _names(model, param_groups(model, o))[-1][1]
        return
    assert _names(model, param_groups(model, o)) == _names(model, decay_groups(model, o))


def test_norms_and_biases_are_not_decayed_by_default():
    model = AutoModelForCausalLM.from_config(hf_config("gpt2"))
    decayed, exempt = _names(model, param_groups(model, typed(compose([])).optim))
    assert decayed[0] == 0.1 and exempt[0] == 0.0
    assert "transformer.h.0.ln_1.weight" in exempt[1] and "transformer.h.0.attn.c_attn.bias" in exempt[1]
    assert "transformer.h.0.attn.c_attn.weight" in decayed[1] and "transformer.wte.weight" in decayed[1]


def test_an_unknown_kind_is_named():
    with pytest.raises(ConfigError, match=r"optim.no_decay: unknown kind\(s\) 'norms'.*use some of bias, 1d"):
        check_optim(typed(compose(["optim.no_decay=[norms]"])).optim)
