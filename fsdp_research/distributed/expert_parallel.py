"""Expert parallel (parallel.ep): each MoE layer's routed experts split over the ep ranks on their expert dimension
(transformers 5's fused experts tensors, [experts, ...]), tokens sent to the ranks that hold their experts and the
results sent back with all-to-all (uneven splits). The routers, shared experts and dense layers stay as they are;
the ep ranks are data-parallel ranks too (ep divides the shard dimension, as torchtitan's dp_shard_in_ep), and the
experts are fully_shard-ed over what is left of it (`dp_mod_ep`).

Each experts module keeps transformers' own forward (its experts implementation: eager, grouped_mm, ...): on each
rank it runs on the tokens routed to the rank's experts, with those experts' local tensors, one expert a token-slot
and weight 1; each token's slots are weighted and summed where the token lives, in expert order as transformers
sums them."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_research.errors import ConfigError


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Path -> each MoE layer's fused routed-experts module (transformers' experts interface: `num_experts` and
    3-D tensors of that many experts)."""
    found = {}
    for path, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if hasattr(module, "_apply_gate") and params and all(p.dim() == 3 and p.shape[0] == experts for p in params):
            found[path] = module
    return found


def split_experts(model: nn.Module, ep: int) -> list[str]:
    """The experts modules parallel.ep splits (each its own FSDP unit): none at ep 1."""
    return list(fused_experts(model)) if ep > 1 else []


def check_ep(model: nn.Module, ep: int) -> None:
    """Raises ConfigError for a model without fused experts, or experts that do not split over ep ranks."""
    experts = fused_experts(model)
    if not experts:
        raise ConfigError(
            "parallel.ep",
            f"{type(model).__name__} has no fused experts modules (transformers' experts interface) to split",
            "use parallel.ep=1",
        )
    counts = {m.num_experts for m in experts.values()}
    bad = next((n for n in sorted(counts) if n % ep), None)
    if bad is not None:
        raise ConfigError("parallel.ep", f"{ep} does not divide the {bad} experts of an MoE layer", "use a divisor")


def apply_ep(model: nn.Module, paths: list[str], mesh: DeviceMesh) -> None:
    """Each experts module's tensors split on dim 0 over the ep mesh (the model may be on the meta device), its
    forward dispatching tokens over the ep group."""
    for path in paths:
        module = model.get_submodule(path)
        for name, param in list(module.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        module.forward = _ExpertParallelForward(module, mesh.get_group())


class _ExpertParallelForward:
    """forward(hidden_states [tokens, hidden], top_k_index, top_k_weights [tokens, k]) of an experts module whose
    tensors hold this rank's experts."""

    def __init__(self, module: nn.Module, group):
        self.module, self.group = module, group
        self.local = module.num_experts // dist.get_world_size(group)
        self.base = type(module).forward

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        ranks, k = dist.get_world_size(self.group), top_k_index.shape[-1]
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, then token: each rank's slots are contiguous
        token = order // k
        owner = expert[order] // self.local
        sent = torch.bincount(owner, minlength=ranks)
        # Filled (not empty) for a backend that moves no data (`simulate`'s fake one): as many in as out, expert 0.
        received = sent.clone()
        dist.all_to_all_single(received, sent, group=self.group)
        sent_splits, received_splits = sent.tolist(), received.tolist()
        local_expert = torch.zeros(sum(received_splits), dtype=expert.dtype, device=expert.device)
        dist.all_to_all_single(
            local_expert, expert[order] - owner * self.local, received_splits, sent_splits, group=self.group
        )
        inputs = _exchange(hidden_states[token], received_splits, sent_splits, self.group)
        outputs = self._local_forward(inputs, local_expert[:, None], inputs.new_ones(len(local_expert), 1))
        outputs = _exchange(outputs, sent_splits, received_splits, self.group)
        weights = top_k_weights.reshape(-1)[order, None].to(outputs.dtype)
        combined = torch.zeros_like(hidden_states)
        return combined.index_add(0, token, (outputs * weights).to(combined.dtype))

    def _local_forward(self, *args):
        """transformers' forward of the module over this rank's experts: their local tensors in the parameters'
        places (views of the DTensors, so the gradients reach them) and num_experts the local count."""
        module = self.module
        params = dict(module._parameters)
        local = {name: p.to_local() for name, p in params.items()}
        module._parameters.update(local)
        module.num_experts = self.local
        try:
            outputs = self.base(module, *args)
            # No token for these experts: still a gradient (of zeros), which FSDP's reduction needs.
            if not len(args[0]):
                outputs = outputs + 0 * sum(p.sum() for p in local.values())
            return outputs
        finally:
            module._parameters.update(params)
            module.num_experts = self.local * dist.get_world_size(self.group)


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows all-to-all over the group, differentiable (the backward sends the gradients back)."""
    return funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)
