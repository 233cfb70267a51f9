"""loss.chunks against what we did not write: transformers' own llama (tied and untied head), its plain logits with
torch's cross_entropy (and PaLM's z-loss, label smoothing) and autograd's gradients, against train_loss with
ChunkedCrossEntropy; and the point of chunking, that the [tokens x vocab] logits never exist at once, seen by a
dispatch mode on every op of forward and backward. In-process, one process, fp32."""

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from fsdp_research.distributed.activation_checkpointing import resolve_op
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.train.losses import ChunkedCrossEntropy, check_chunkable, token_losses, train_loss
from fsdp_research.train.refusals import check_sharding
from tests.helpers.zoo import hf_config

VOCAB = 512
# 200 tokens: more than the hidden size (64), so tokens x vocab outgrows the [vocab x hidden] embedding gradient, and
# seq_len x heads (200) under the vocabulary, so the attention scores do too: the logits are the largest tensor.
BATCH, SEQ = 4, 50
TOKENS = BATCH * SEQ


class _Largest(TorchDispatchMode):
    """The largest floating-point tensor any op makes while active (outputs, views included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    torch.manual_seed(0)
    config = hf_config("llama", vocab_size=VOCAB, tie_word_embeddings=request.param)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Tied: one parameter gets the embedding's and the head's gradients; untied: two.
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == request.param
    return model


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _reference(model, batch, z_loss: float, label_smoothing: float) -> torch.Tensor:
    """Transformers' logits, torch's cross-entropy, PaLM's z-loss (z_loss x mean of logsumexp^2) written out."""
    logits = model(input_ids=batch[:, :-1]).logits.flatten(0, 1)
    loss = F.cross_entropy(logits, batch[:, 1:].flatten(), label_smoothing=label_smoothing)
    return loss + z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()


def _loss_and_grads(model, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor], int, int]:
    """compute()'s loss, each parameter's gradient, and the largest float tensor made in forward and in backward."""
    model.zero_grad(set_to_none=True)
    with _Largest() as forward:
        loss = compute()
    with _Largest() as backward:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.detach(), grads, forward.largest, backward.largest


@pytest.mark.parametrize("z_loss, label_smoothing", [(0.0, 0.0), (1e-2, 0.1)], ids=["plain", "z_smoothed"])
@pytest.mark.parametrize("chunks", [3, 8])  # 200 tokens: 3 uneven chunks (67, 67, 66), 8 even ones
def test_chunked_loss_equals_transformers_reference(model, batch, chunks, z_loss, label_smoothing):
    ref_loss, ref_grads, ref_fwd, ref_bwd = _loss_and_grads(
        model, lambda: _reference(model, batch, z_loss, label_smoothing)
    )
    # The probe sees the full logits where they exist: made in forward, their gradient in backward.
    assert ref_fwd >= TOKENS * VOCAB and ref_bwd >= TOKENS * VOCAB, (ref_fwd, ref_bwd)

    loss_fn = ChunkedCrossEntropy(chunks, z_loss, label_smoothing)
    loss, grads, fwd, bwd = _loss_and_grads(
        model, lambda: train_loss(model, batch, contextlib.nullcontext(), loss_fn)[0]
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # One chunk's logits at a time, in forward and in the backward's recompute.
    assert fwd < TOKENS * VOCAB and bwd < TOKENS * VOCAB, (fwd, bwd)
    # The output layer of the model is itself again: the bypass is undone.
    assert model(input_ids=batch[:1, :4]).logits.shape[-1] == VOCAB


def test_check_chunkable_refuses_soft_capped_logits():
    torch.manual_seed(0)
    gemma = AutoModelForCausalLM.from_config(hf_config("gemma2", vocab_size=VOCAB, final_logit_softcapping=30.0))
    with torch.no_grad(), pytest.raises(ConfigError) as error:
        check_chunkable(gemma, torch.device("cpu"))
    assert error.value.key == "loss.chunks" and "loss.chunks" in str(error.value)
    llama = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=VOCAB))
    with torch.no_grad():
        check_chunkable(llama, torch.device("cpu"))


def test_eval_losses_in_chunks_equal_whole(model):
    """Eval with loss.chunks makes the logits a slice at a time too: each token's loss as the whole logits give it."""
    batch = torch.randint(0, VOCAB, (3, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = token_losses(model, batch, contextlib.nullcontext())
        chunked = token_losses(model, batch, contextlib.nullcontext(), chunks=7)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_a_head_that_is_not_a_plain_linear_is_refused(model):
    """Chunks compute F.linear with the head's weight: a hook (or a subclass's forward) would be skipped."""
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    try:
        with pytest.raises(ConfigError, match=r"^loss\.chunks: .* not a plain nn\.Linear"):
            check_chunkable(model, torch.device("cpu"))
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["sharding=no_reshard", "sharding.reshard_after_forward=2"], "sharding.reshard_after_forward"),
        (["sharding.reshard_after_forward=1"], "sharding.reshard_after_forward"),
        (["sharding.reshard_override={0:3}"], "sharding.reshard_override.0"),
        (["sharding=root_only", "sharding.prefetch_forward=1"], "sharding.prefetch_forward"),
        (["sharding.prefetch_backward=-1"], "sharding.prefetch_backward"),
    ],
)
def test_sharding_knobs_refused_before_any_compute(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: "):
        check_sharding(compose(overrides).sharding, 4)


def test_save_ops_take_overload_names():
    assert resolve_op("aten.mm.default") is resolve_op("aten.mm") is torch.ops.aten.mm
