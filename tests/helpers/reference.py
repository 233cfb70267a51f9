"""The single-process run every sharded run must reproduce, built from what we did not write: transformers'
from_pretrained of the initial weights, torch.optim.AdamW, the schedule written out here, and each step's batch
read from the token store's files with numpy (synthetic data: from its generator's definition). Only the order of
the windows is taken from fsdp_research.data.sampling (its properties are tests/data/test_data.py's)."""

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from fsdp_research.config.schema import typed
from fsdp_research.data.pipeline import store_root, store_specs
from fsdp_research.data.sampling import Stream


class _Positions:
    """A source of `count` windows whose contents are their own indices: what Stream returns is the order."""

    def __init__(self, count: int, length: int):
        self.count, self.length = count, length

    def read(self, index: np.ndarray) -> np.ndarray:
        return np.repeat(index[:, None], self.length, axis=1)


def _store_tokens(cfg: DictConfig) -> np.ndarray:
    """The one source's tokens, concatenated from its part files as the manifest lists them."""
    [spec] = store_specs(cfg.data)
    path = os.path.join(store_root(cfg.data), spec.fingerprint)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    parts = [np.fromfile(os.path.join(path, f"part_{i:05d}.tokens"), dtype=manifest["dtype"])
             for i in range(len(manifest["parts"]))]  # fmt: skip
    return np.concatenate(parts).astype(np.int64)


def batches(cfg: DictConfig, vocab_size: int):
    """batch(step): the global batch of a step, [global_batch_size, seq_len + 1]."""
    t, length = cfg.trainer, cfg.data.seq_len + 1
    if cfg.data.kind.value == "synthetic":

        def window(i: int) -> np.ndarray:
            return np.random.default_rng([t.seed, i]).integers(0, vocab_size, length)

        count = cfg.data.num_sequences
    else:
        tokens = _store_tokens(cfg)

        def window(i: int) -> np.ndarray:
            return tokens[i * length : (i + 1) * length]

        count = len(tokens) // length
    order = Stream([_Positions(count, length)], [1.0], t.seed, cfg.data.eval_fraction)

    def batch(step: int) -> torch.Tensor:
        index = order.train(step * t.global_batch_size + np.arange(t.global_batch_size))[:, 0]
        return torch.from_numpy(np.stack([window(int(i)) for i in index]))

    return batch


def factor_at(cfg: DictConfig, step: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr_ratio at max_steps."""
    s, total = cfg.schedule, cfg.trainer.max_steps
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_groups(model, o) -> list[dict]:
    """AdamW's groups as the config names them, written out here: biases and vectors by name and shape, embeddings
    by transformers' own accessors."""
    embeddings = {id(model.get_input_embeddings().weight)}
    if model.config.tie_word_embeddings:
        embeddings.add(id(model.get_output_embeddings().weight))
    exempt = {
        name
        for name, p in model.named_parameters()
        if ("bias" in o.no_decay and name.endswith(".bias"))
        or ("1d" in o.no_decay and p.dim() == 1)
        or ("embedding" in o.no_decay and id(p) in embeddings)
    }
    return [
        {"params": [p for n, p in model.named_parameters() if n not in exempt], "weight_decay": o.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n in exempt], "weight_decay": 0.0},
    ]


def expert_bias_updates(model, rate: float):
    """DeepSeek-V3's aux-loss-free balancing written out from its formula: each router that carries an
    e_score_correction_bias returns (logits, weights, chosen experts); after each step its bias moves by
    rate * sign(mean load - load) over the step's tokens, the change recentred to zero mean. Returns update()."""
    routers = [m for m in model.modules() if "e_score_correction_bias" in m._buffers]
    loads = {id(m): torch.zeros(m.e_score_correction_bias.numel()) for m in routers}

    def count(module, args, output):
        loads[id(module)] += torch.bincount(output[-1].flatten(), minlength=len(loads[id(module)])).float()

    for m in routers:
        m.register_forward_hook(count)

    @torch.no_grad()
    def update():
        for m in routers:
            load = loads[id(m)]
            change = rate * torch.sign(load.mean() - load)
            m.e_score_correction_bias += change - change.mean()
            load.zero_()

    return update


def adamw(model, cfg) -> list[tuple[torch.optim.Optimizer, float]]:
    """torch's AdamW over the decay groups; with its base learning rate."""
    o = cfg.optim
    return [(torch.optim.AdamW(decay_groups(model, o), lr=o.lr, betas=tuple(o.betas), eps=o.eps), o.lr)]


def reference_run(
    cfg, initial: str, optimizers=adamw, norms: list[float] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and final weights of the whole global batch in one forward, from the weights in `initial`
    (a directory written by save_pretrained); optimizers(model, cfg): [(optimizer, its base lr), ...]; each step's
    gradient norm appended to `norms` where given."""
    from transformers import AutoModelForCausalLM

    cfg = typed(cfg)
    model = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32)
    o = cfg.optim
    parts = optimizers(model, cfg)
    batch = batches(cfg, model.config.vocab_size)
    balance = expert_bias_updates(model, cfg.model.moe.bias_update_rate)
    losses = []
    for step in range(cfg.trainer.max_steps):
        for optimizer, base in parts:
            for group in optimizer.param_groups:
                group["lr"] = base * factor_at(cfg, step)
        tokens = batch(step)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        if norms is not None:
            norms.append(norm.item())
        for optimizer, _ in parts:
            optimizer.step()
        balance()
        model.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained_from_initial(out, base: list[str], by_world: dict[int, dict[str, list[str]]]):
    """The llama of `base` as transformers initialises it, written once by save_pretrained; each named config
    (base + its overrides) trained from it on its world size, the configs of one world size in one group of
    processes. Returns (base overrides that load it, its directory, {name: losses and final weights})."""
    from transformers import AutoConfig

    from fsdp_research.jobs.compose import compose
    from tests.helpers.dist import train_distributed

    initial = save_initial(AutoConfig.for_model("llama", **compose(base).model.config), str(out / "initial"))
    base = base + ["model=pretrained", f"model.name_or_path={initial}"]
    runs = {}
    for world, configs in by_world.items():
        runs.update(
            train_distributed({n: compose(base + extra) for n, extra in configs.items()}, world, str(out / f"w{world}"))
        )
    return base, initial, runs


def save_initial(hf_config, out_dir: str, seed: int = 0) -> str:
    """Initial weights as transformers makes them (from_config), written by save_pretrained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(out_dir)
    return out_dir
