"""The single-process plain PyTorch run that every sharded run must reproduce: no FSDP, no DDP, the whole
global batch in one forward."""

from typing import Any

import torch
import torch.nn.functional as F

from fsdp_research.config import typed
from fsdp_research.data.pipeline import build_data
from fsdp_research.initialization import init_weights, materialize
from fsdp_research.models import build_hf_config, build_model
from fsdp_research.optim import build_optimizer


def reference_run(cfg: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = typed(cfg)
    t = cfg.trainer
    hf_config = build_hf_config(cfg.model)
    model = build_model(hf_config)
    materialize(model, torch.device("cpu"))
    init_weights(model, t.seed)
    data = build_data(cfg.data, hf_config.vocab_size, t.seed)
    optimizer, scheduler = build_optimizer(model, cfg.optim, t.max_steps)
    losses = []
    for step in range(t.max_steps):
        batch = data.global_batch(step, t.global_batch_size)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
