"""GRPO's rollouts: the hashed noise samples the temperature-scaled, top-p filtered distribution (transformers'
warper); batched, left-padded generation with a KV cache gives each prompt what the Hugging Face model gives it fed
alone without a cache, whatever the batch holds; the log-probabilities the generator returns are the ones a forward
over prompt and completion computes, and objective=grpo's training forward too (open-instruct's 570x divergence as a
check); on 2 FSDP ranks
(real processes, gloo), each with half the prompts and stopping at different steps, the same completions."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import TopPLogitsWarper

from fsdp_research.objectives.grpo import GRPO
from fsdp_research.objectives.rollouts import Sampling, generate, sample_next
from tests.helpers.chats import chat_llama
from tests.helpers.dist import run_distributed

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "def f(x): return", "Why?", "Count to three.", "Say hi."]
SAMPLING = Sampling(max_tokens=10, temperature=0.9, top_p=0.95)


def test_the_noise_samples_the_top_p_distribution():
    n = 40_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    tokens, logps = sample_next(logits.repeat(n, 1), torch.arange(n) * 7919, 3, Sampling(1, 0.7, 0.9))
    want = TopPLogitsWarper(0.9)(None, logits / 0.7).softmax(-1)[0]
    assert (torch.bincount(tokens, minlength=6) / n - want).abs().max() < 0.01  # 4 standard errors
    torch.testing.assert_close(logps, (logits / 0.7).log_softmax(-1)[0, tokens])  # before top-p, as TRL's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_llama(str(tmp_path_factory.mktemp("rollouts") / "model"))


def _prompts(model_dir: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [n, P] left-padded, which are real, keys)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    batch = tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"].bool(), torch.arange(len(QUESTIONS)) * 104_729 + 11


def _stops(vocab: int) -> set[int]:
    """Half the vocabulary: a random model's sequences end at different steps."""
    return set(range(0, vocab, 2))


def _model(model_dir: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)


def test_each_prompt_gets_what_the_model_gives_it_alone_and_its_logps(model_dir):
    model = _model(model_dir)
    ids, real, keys = _prompts(model_dir)
    stop = _stops(model.config.vocab_size) - {0}
    out = generate(model, ids, real, keys, SAMPLING, stop, 0)
    assert out.mask.sum(1).min() < out.mask.sum(1).max()  # ended at different steps
    for i in range(len(ids)):
        seq, got = ids[i][real[i]].tolist(), []
        for t in range(SAMPLING.max_tokens):  # no cache, no padding
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[:, -1]
            token, _ = sample_next(logits, keys[i : i + 1], t, SAMPLING)
            got.append(int(token))
            seq.append(got[-1])
            if got[-1] in stop:
                break
        n = int(out.mask[i].sum())
        assert out.ids[i, :n].tolist() == got and not out.mask[i, n:].any()
        # The trainer's view: one forward over prompt and completion, temperature-scaled.
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, -n - 1 : -1] / SAMPLING.temperature
        want = logits.log_softmax(-1).gather(-1, torch.tensor(got)[:, None])[:, 0]
        torch.testing.assert_close(out.logps[i, :n], want, rtol=1e-5, atol=1e-5)
    some = generate(model, ids[[4, 1]], real[[4, 1]], keys[[4, 1]], SAMPLING, stop, 0)
    assert torch.equal(some.ids, out.ids[[4, 1]])  # a batch of others: the same completions
    # objective=grpo's training forward, a micro-batch of 3 at a time (each without the columns none of it fills):
    # the generator's log-probabilities.
    grpo = GRPO(max_completion_length=SAMPLING.max_tokens, temperature=SAMPLING.temperature)
    grpo.step = {
        "tokens": torch.cat([ids, out.ids], 1),
        "attention": torch.cat([real, out.mask], 1).long(),
        "ids": out.ids,
        "mask": out.mask,
    }
    with torch.no_grad():
        trained = [grpo._logps(model, rows[:, None], contextlib.nullcontext())[0] for rows in torch.arange(6).split(3)]
    torch.testing.assert_close(torch.cat(trained) * out.mask, out.logps, rtol=1e-5, atol=1e-5)


def _on_two_ranks(model_dir: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.jobs.compose import compose

    init_distributed(typed(compose([])).distributed, torch.device("cpu"))
    model = _model(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, real, keys = _prompts(model_dir)
    half = len(ids) // 2
    mine = slice(dist.get_rank() * half, (dist.get_rank() + 1) * half)
    stops = _stops(model.config.vocab_size) - {0}
    out = generate(model, ids[mine], real[mine], keys[mine], SAMPLING, stops, 0)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    each_token = generate(model, ids[mine], real[mine], keys[mine], SAMPLING, stops, 0, gather=False)
    with torch.no_grad():
        model(input_ids=ids[mine])
    parts = [None, None]
    dist.all_gather_object(parts, (out.ids, out.mask, out.logps))
    return {
        "ids": torch.cat([p[0] for p in parts]),
        "mask": torch.cat([p[1] for p in parts]),
        "logps": torch.cat([p[2] for p in parts]),
        "sharded after": sharded,
        "as gathered each token": all(torch.equal(getattr(out, f), getattr(each_token, f)) for f in ("ids", "logps")),
        # As before the generation: the blocks reshard after a forward, the root keeps its parameters gathered.
        "after a forward": [
            isinstance(p, DTensor) for p in (model.model.layers[0].mlp.up_proj.weight, model.lm_head.weight)
        ],
    }


@pytest.mark.slow  # 2 processes of their own
@pytest.mark.distributed
def test_two_fsdp_ranks_sample_what_one_process_does(model_dir):
    ids, real, keys = _prompts(model_dir)
    model = _model(model_dir)
    one = generate(model, ids, real, keys, SAMPLING, _stops(model.config.vocab_size) - {0}, 0)
    two = run_distributed(_on_two_ranks, 2, model_dir)
    assert torch.equal(two["ids"], one.ids) and torch.equal(two["mask"], one.mask)
    torch.testing.assert_close(two["logps"], one.logps, rtol=1e-5, atol=1e-6)
    # The parameters gathered once for the generation, not at each token: the same completions, to the bit; then
    # sharded again, each unit's reshard_after_forward as it was.
    assert two["as gathered each token"] and two["sharded after"]
    assert two["after a forward"] == [True, False]
