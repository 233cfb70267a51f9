"""LoRA (model.lora) with PEFT: its adapters injected into the model on the meta device before sharding (so each
block's adapters shard in the block's unit), the base frozen; the base's pretrained weights read into the shards
with the adapters set aside; the adapters initialised as PEFT initialises them (A kaiming-uniform, B zeros), each
from its own seed, whole on every rank, so alike at any world size; and the adapters merged into the base for an
export."""

import collections
import contextlib
import hashlib
import math
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_research.config.schema import LoraSettings, ModelConfig
from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.sharding import local_shard, reshard
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import pretrained_dir
from fsdp_research.model.pretrained import weights_identity

ADAPTER = "default"
# Where an export keeps the adapters in PEFT's format: <export>/adapter.
ADAPTER_DIR = "adapter"


def peft_config(cfg: LoraSettings):
    from peft import LoraConfig

    targets = cfg.target_modules
    if not isinstance(targets, str):
        targets = list(targets)
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(cfg.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )


def enabled(cfg: LoraSettings) -> bool:
    return cfg.r is not None


def check_lora(cfg: LoraSettings, load_weights: bool) -> None:
    if not enabled(cfg):
        return
    if cfg.r < 1:
        raise ConfigError("model.lora.r", f"{cfg.r} is below 1", "use a rank of 1 or more, e.g. 8")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError("model.lora.dropout", f"{cfg.dropout} is not in [0, 1)", "use e.g. 0.05")
    if not load_weights:
        raise ConfigError(
            "model.lora", "adapts pretrained weights, but model.load_weights is false", "use model=pretrained"
        )


def apply_lora(model: nn.Module, cfg: LoraSettings) -> None:
    """PEFT's adapters injected in place (the model keeps its class and its names, the targets' weights moving to
    <target>.base_layer), every other parameter frozen. Raises ConfigError for targets PEFT cannot adapt."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            "model.lora.target_modules",
            f"PEFT cannot adapt {cfg.target_modules!r} in {type(model).__name__}: {str(err).splitlines()[0]}",
            "name Linear modules the model has (e.g. q_proj,v_proj), or all-linear",
        ) from None
    from peft.tuners.lora import Linear

    odd = next((name for name, layer in lora_layers(model) if not isinstance(layer, Linear)), None)
    if odd:
        raise ConfigError(
            "model.lora.target_modules",
            f"{odd} is not a Linear layer (LoRA here adapts Linear and Conv1D layers only)",
            "name Linear modules, e.g. q_proj,v_proj, or all-linear",
        )
    for name, param in model.named_parameters():
        param.requires_grad_(_is_adapter(name))
    _check_untied(model)


def _check_untied(model: nn.Module) -> None:
    """A module whose weights another shares (tied embeddings) cannot train a copy of its own: the export would
    hold one tensor for two that training made different."""
    for name, wrapper in saved_modules(model):
        inside = {id(p) for p in wrapper.original_module.parameters()}
        outside = (p for n, p in model.named_parameters(remove_duplicate=False) if not n.startswith(f"{name}."))
        if any(id(p) in inside for p in outside):
            raise ConfigError(
                "model.lora.modules_to_save",
                f"{clean_name(name)} shares its weights with another module (tie_word_embeddings)",
                "leave tied modules out of modules_to_save",
            )


def store_frozen(model: nn.Module, dtype: torch.dtype, kept_in_fp32: list[str]) -> None:
    """The frozen base stored in the compute dtype (all FSDP2 gathers it in; no gradient or optimizer state needs
    it in fp32), but for the modules the family keeps in fp32; the trained parameters stay fp32, of one dtype as
    FSDP2 requires of a unit's trained parameters."""
    kept = tuple(f"{path}." for path in kept_in_fp32)
    for name, param in model.named_parameters():
        if not param.requires_grad and not name.startswith(kept):
            param.data = param.data.to(dtype)


def base_identity(cfg: ModelConfig) -> str | None:
    """With LoRA, what identifies the pretrained weights cheaply (model.pretrained.weights_identity); None
    without."""
    return weights_identity(pretrained_dir(cfg.name_or_path)) if enabled(cfg.lora) else None


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or f".modules_to_save.{ADAPTER}." in name


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module path as named_modules says it, layer) of each adapted layer."""
    lora = sys.modules.get("peft.tuners.lora")
    if lora is None:  # never imported: nothing was adapted (and a run without LoRA does not pay for the import)
        return
    for name, module in model.named_modules():
        if isinstance(module, lora.LoraLayer):
            yield name, module


def saved_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module path, PEFT's wrapper) of each module model.lora.modules_to_save trains a copy of."""
    other = sys.modules.get("peft.utils.other")
    if other is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, other.ModulesToSaveWrapper):
            yield name, module


@contextlib.contextmanager
def base_view(model: nn.Module) -> Iterator[nn.Module]:
    """The model with each adapted layer's base layer back in its place and each module of modules_to_save's
    trained copy in its place (the pretrained checkpoint's names, which the copy is loaded into and exported
    under), for as long as the context lasts; the parameters are the same objects."""
    stand_ins = [(name, layer, layer.base_layer) for name, layer in lora_layers(model)]
    stand_ins += [(name, wrapper, wrapper.modules_to_save[ADAPTER]) for name, wrapper in saved_modules(model)]
    swapped = []
    for name, layer, stand_in in stand_ins:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent._modules[child] = stand_in
        swapped.append((parent, child, layer))
    try:
        yield model
    finally:
        for parent, key, layer in swapped:
            parent._modules[key] = layer


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def _local_part(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a tensor of param's shape every rank has whole (no communication)."""
    local = local_shard(param)
    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(local.device), param.device_mesh, param.placements, src_data_rank=None)
        full = full.to_local()
    return full.to(local.device, local.dtype)


def _set_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        local_shard(param).copy_(_local_part(param, full))


def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation (reset_lora_parameters): A kaiming-uniform (a = sqrt(5)), B zeros; A from a generator
    of its own name and the run's seed. The frozen original of each module of modules_to_save: its loaded copy's
    values (PEFT's deepcopy; both are sharded alike)."""
    for name, layer in lora_layers(model):
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        _set_whole(a, initial_a(seed, clean_name(name), a.shape))
        with torch.no_grad():
            local_shard(b).zero_()
    for _, wrapper in saved_modules(model):
        copies = wrapper.modules_to_save[ADAPTER].parameters()
        with torch.no_grad():
            for original, copy in zip(wrapper.original_module.parameters(), copies, strict=True):
                local_shard(original).copy_(local_shard(copy))


def initial_a(seed: int, layer: str, shape: torch.Size) -> torch.Tensor:
    """The adapted layer's initial A, whole: kaiming_uniform_(a=sqrt(5)) (gain sqrt(2 / 6), bound gain x
    sqrt(3 / fan_in) = 1 / sqrt(fan_in)) from a generator of the layer's name and the run's seed."""
    generator = torch.Generator().manual_seed(_seed(seed, layer))
    bound = 1 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def export_adapter(model: nn.Module, cfg: ModelConfig, out_dir: str) -> None:
    """The adapters as PEFT saves them (adapter_config.json, adapter_model.safetensors: PeftModel.from_pretrained
    loads the directory onto the base), gathered whole to rank 0, which writes them (a collective)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(getattr(model, "module", model), options=options)
    if dist.get_rank() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    # PEFT's names: under its wrapper's prefix, without the adapter's name (a trained copy under its module's).
    tensors = {f"base_model.model.{_peft_name(clean_name(name))}": value.contiguous() for name, value in state.items()}
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(cfg.lora)
    config.base_model_name_or_path = cfg.name_or_path
    config.save_pretrained(out_dir)


def _peft_name(name: str) -> str:
    return name.replace(f".modules_to_save.{ADAPTER}.", ".").replace(f".{ADAPTER}.", ".")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def merged(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The adapters merged into the base weights (PEFT's get_delta_weight: B A x alpha / r, transposed for a
    fan-in-fan-out layer) and the base view of the model, for as long as the context lasts; the base's shards as
    they were after (a collective: every rank calls it). Yields the merged weights an export writes apart, by name:
    those of adapted layers whose weight another module shares (a head tied to the input embedding), left as they
    are in the model, where an added delta would change the other module too."""
    # An eval's forward left units gathered: their shards are what the export reads and what is restored.
    reshard(model)
    kept, apart = [], {}
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name, layer in lora_layers(model):
        weight = layer.base_layer.weight
        a, b = _full(layer.lora_A[ADAPTER].weight.detach()), _full(layer.lora_B[ADAPTER].weight.detach())
        delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
        part = _local_part(weight, delta.T if layer.fan_in_fan_out else delta)  # this rank's rows of the delta
        if uses[id(weight)] > 1:
            apart[f"{clean_name(name)}.weight"] = _like(weight, local_shard(weight).detach() + part)
            continue
        kept.append((weight, local_shard(weight).detach().to("cpu", copy=True)))
        with torch.no_grad():
            local_shard(weight).add_(part)
    try:
        with base_view(model):
            yield apart
    finally:
        for weight, value in kept:
            with torch.no_grad():
                local_shard(weight).copy_(value)


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as param (a DTensor's placements) with `local` as this rank's part."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
