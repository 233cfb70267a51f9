"""Weights in: a Hugging Face checkpoint (safetensors, one file or sharded with an index) into the (possibly
sharded) model, through transformers' own loading machinery: its conversion mapping for the family (key renames,
experts stored one by one and fused in the model, split or fused projections, prefixes).

Tensors whose conversion keeps rows in place (renames, experts stacked along dim 0, concatenations along a later
dim) are read shard-on-read: each rank reads only the region its DTensor shard covers (and skips the experts it
does not own). Tensors whose conversion moves rows (q/k/v_conv1d -> conv1d, query_key_value -> q/k/v, ...) are
read whole, converted as from_pretrained converts them, and each rank keeps its part: one conversion in flight.

Before anything is read, a dry run on the meta device (checkpoint tensors by shape only) checks that every
model tensor is found, that no checkpoint tensor is left over, and that every shape matches as a whole. After
the load every tensor is checked against the checkpoint: a checksum of each rank's part (position-weighted, so
moved rows count) summed over the shards equals the whole tensor's, converted from the files by a second,
unsharded pass that the ranks share; a tensor that differs (or stayed uninitialised) refuses the run by name."""

import contextlib
import hashlib
import importlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.sharding import local_shard
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import build_model

_FIX = "use a checkpoint of this model's architecture (model.name_or_path), without model.config overrides of shapes"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory: the ones its index lists (all of them must be there), or
    its one model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in files if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise ConfigError(
                "model.name_or_path",
                f"{path}'s index lists {', '.join(missing)}, which is not there",
                "download the checkpoint again, complete",
            )
        return [os.path.join(path, name) for name in files]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ConfigError(
            "model.name_or_path",
            f"{path} holds no model.safetensors(.index.json)",
            "point it at a directory written by save_pretrained (safetensors)",
        )
    return [single]


def weights_identity(path: str) -> str:
    """What identifies a checkpoint's weights cheaply: each safetensors file's size, header (names, dtypes, shapes,
    offsets) and first and last MiB."""
    digest = hashlib.sha256()
    for file in checkpoint_files(path):
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            header = 8 + int.from_bytes(f.read(8), "little")
            f.seek(0)
            digest.update(f"{os.path.basename(file)} {size}".encode() + f.read(header + 2**20))
            f.seek(max(header, size - 2**20))
            digest.update(f.read())
    return digest.hexdigest()


def _slices(files: list[str], handles: ExitStack, meta: bool) -> dict[str, Any]:
    """Every checkpoint tensor, unread: safetensors slices, or meta tensors of their shapes (for the dry run)."""
    state = {}
    for file in files:
        handle = handles.enter_context(safe_open(file, "pt"))
        for key in handle.keys():
            piece = handle.get_slice(key)
            state[key] = torch.empty(piece.get_shape(), device="meta") if meta else piece
    return state


# The transformers this loading was written against: its loading API below is internal (no stability promise).
TESTED_TRANSFORMERS = "5.24"


def hf_internal(module: str, *names: str) -> tuple:
    """Names of transformers' internal loading API (transformers.<module>), in one place: a release that moved
    them fails with one line naming the version and what is missing, not deep inside a load."""
    try:
        found = importlib.import_module(f"transformers.{module}")
        return tuple(getattr(found, name) for name in names)
    except (ImportError, AttributeError) as err:
        import transformers

        raise ConfigError(
            "model.load_weights",
            f"transformers {transformers.__version__} lacks its internal loading API that this uses ({err})",
            f"install transformers {TESTED_TRANSFORMERS}.x (what it was tested with), or model.load_weights=false",
        ) from None


def _mapping(model: nn.Module) -> list:
    """The family's conversion mapping, from an unwrapped twin: FSDP renames the classes it wraps
    (FSDPGPTNeoXForCausalLM), and transformers looks mappings up by class name."""
    (get_model_conversion_mapping,) = hf_internal("conversion_mapping", "get_model_conversion_mapping")
    return get_model_conversion_mapping(_twin(model.config))


def _twin(hf_config) -> nn.Module:
    """The family's model on the meta device, shapes and conventions only (what loading needs of it): built
    without values, which a twin built again at every load and check would cost each time."""
    return build_model(hf_config, values=False)


def _load(model: nn.Module, mapping: list, state: dict[str, Any], device: str):
    """transformers' loading of checkpoint tensors into the model; returns its loading report."""
    from transformers.utils import logging as hf_logging

    (convert_and_load_state_dict_in_model,) = hf_internal("core_model_loading", "convert_and_load_state_dict_in_model")
    (LoadStateDictConfig,) = hf_internal("modeling_utils", "LoadStateDictConfig")

    hf_logging.disable_progress_bar()
    config = LoadStateDictConfig(weight_mapping=mapping, device_map={"": device})
    info, _ = convert_and_load_state_dict_in_model(model, state, config)
    return info


def _first(keys, n: int = 3) -> str:
    keys = sorted(map(str, keys))
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def check_weights(hf_config, path: str) -> None:
    """The dry run: raises ConfigError for a checkpoint that does not fit the model the config builds."""
    model = _twin(hf_config)
    with ExitStack() as handles:
        info = _load(model, _mapping(model), _slices(checkpoint_files(path), handles, meta=True), "meta")
    missing = set(info.missing_keys) - set(getattr(model, "all_tied_weights_keys", None) or {})
    if info.mismatched_keys:
        shapes = [
            f"{key} is {list(ours)} in the model, {list(theirs)} in the checkpoint"
            for key, theirs, ours in sorted(info.mismatched_keys)
        ][:3]
        raise ConfigError("model.config", f"{path} does not fit {type(model).__name__}: {'; '.join(shapes)}", _FIX)
    if missing or info.unexpected_keys or info.conversion_errors:
        parts = [
            f"missing {_first(missing)}" if missing else "",
            f"unexpected {_first(info.unexpected_keys)}" if info.unexpected_keys else "",
            f"not convertible {_first(info.conversion_errors)}" if info.conversion_errors else "",
        ]
        problem = f"{path} does not fit {type(model).__name__}: {'; '.join(p for p in parts if p)}"
        raise ConfigError("model.name_or_path", problem, _FIX)


def _registered(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param


def _shard_safe(converter) -> bool:
    """Whether shard-on-read gives the right rows for a conversion: each rank reads the rows of the source
    tensors that its rows of the target come from. True for experts stacked along dim 0 (each rank keeps the
    experts it owns) and for concatenations or chunks along a later dim; not for anything that moves rows."""
    Chunk, Concatenate, MergeModulelist = hf_internal("core_model_loading", "Chunk", "Concatenate", "MergeModulelist")

    def safe(op) -> bool:
        if type(op) is MergeModulelist:
            return op.dim == 0
        return type(op) in (Concatenate, Chunk) and op.dim >= 1

    return all(safe(op) for op in converter.operations)


def _targets(model: nn.Module, mapping: list, keys) -> dict[str, tuple[str, bool]]:
    """Each checkpoint key -> (the model tensor it is converted into, whether its conversion is shard-safe),
    renamed as transformers' convert_and_load_state_dict_in_model renames it."""
    WeightConverter, WeightRenaming, rename_source_key = hf_internal(
        "core_model_loading", "WeightConverter", "WeightRenaming", "rename_source_key"
    )

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    state, prefix = model.state_dict(), model.base_model_prefix
    out = {}
    for key in keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=state)
        out[key] = (renamed, pattern is None or _shard_safe(by_pattern[pattern]))
    return out


@contextlib.contextmanager
def _each_whole_tensor(receive: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """While it is open, transformers' loading into an unsharded meta-device model hands each converted tensor,
    whole, to receive(name, tensor) and keeps only its shape: one conversion in flight (loading synchronously:
    its thread pool would read every tensor ahead)."""
    from transformers import core_model_loading

    keep = core_model_loading.set_param_for_module

    def set_param(model, target_name, value, loading_info, hf_quantizer):
        receive(target_name, value.detach())
        keep(model, target_name, value.detach().to("meta"), loading_info, hf_quantizer)

    previous = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    core_model_loading.set_param_for_module = set_param
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        core_model_loading.set_param_for_module = keep
        if previous is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD")
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = previous


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by every name they have (tied ones by each), without wrappers."""
    pairs = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {clean_name(name): tensor for name, tensor in pairs}


def _whole_pass(hf_config, mapping: list, files: list[str], keys, receive) -> None:
    """The checkpoint keys `keys` read whole and converted as from_pretrained converts them, into a meta twin,
    each converted tensor handed to receive(name, tensor)."""
    twin = _twin(hf_config)
    with ExitStack() as handles, _each_whole_tensor(receive):
        state = {k: v for k, v in _slices(files, handles, meta=False).items() if k in keys}
        if state:
            _load(twin, mapping, state, "cpu")


# Elements summed at a time: the float64 temporaries stay small whatever the tensor's size.
_CHUNK = 2**22


def _checksum(values: torch.Tensor, offsets: Sequence[int] = (), shape: Sequence[int] = ()) -> torch.Tensor:
    """(sum, position-weighted sum, sum of magnitudes) of a tensor's values, the part at `offsets` of a tensor of
    `shape` (default: the whole); the weights in [0.5, 1.5) follow the golden-ratio sequence of the whole tensor's
    flat index, so a part read into the wrong place (rows or columns: FSDP's and tensor parallel's shards) shows."""
    local = values.shape
    offsets, shape = list(offsets) or [0] * len(local), list(shape) or list(local)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    flat = values.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK].to("cpu", torch.float64)
        position, index = torch.arange(start, start + chunk.numel()), torch.zeros(chunk.numel(), dtype=torch.int64)
        for d in reversed(range(len(local))):
            index += (position % local[d] + offsets[d]) * strides[d]
            position = position // local[d]
        weights = torch.frac(index.double() * 0.6180339887498949) + 0.5
        sums += torch.stack([chunk.sum(), (chunk * weights).sum(), chunk.abs().sum()])
    return sums


def _local_checksum(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's part's checksum, scaled so that the sum over the `world` ranks holding the model is the whole
    tensor's (a replica's part counts once)."""
    if not isinstance(tensor, DTensor):
        return _checksum(tensor) / world
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    copies = world // tensor.device_mesh.size() if tensor.device_mesh.ndim else 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            copies *= tensor.device_mesh.size(dim)
    return _checksum(tensor.to_local(), offsets, tensor.shape) / copies


def verify_loaded(
    model: nn.Module, path: str, mapping: list, files: list[str], targets: dict, group: dist.ProcessGroup | None
) -> None:
    """Every loaded tensor against the checkpoint (a collective of `group`, the ranks holding the model: a pipeline
    stage's, or every rank). Each rank converts a share of the checkpoint's tensors whole, as from_pretrained would;
    ConfigError names the first tensor whose checksum differs."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tensors = _tensors(model)
    # One name per tensor (the first); a tensor the checkpoint does not fill is never recorded, and not compared.
    first = {}
    for name, tensor in tensors.items():
        first.setdefault(id(tensor), name)
    persistent = set(model.state_dict())
    names = sorted({first[id(tensor)] for name, tensor in tensors.items() if name in persistent})
    row = {name: i for i, name in enumerate(names)}

    def tensor_of(target: str) -> str:
        # Checkpoint keys that fill one tensor (tied copies saved twice) are one rank's work: it is recorded once.
        return first[id(tensors[target])] if target in tensors else target

    share = {t: i % world for i, t in enumerate(sorted({tensor_of(t) for t, _ in targets.values()}))}
    mine = {k for k, (target, _) in targets.items() if share[tensor_of(target)] == rank}
    # Per tensor: the checksum converted from the files, then the loaded parts', then whether it was recorded.
    sums = torch.zeros(len(names), 7, dtype=torch.float64)

    def record(name: str, whole: torch.Tensor) -> None:
        tensor = tensors.get(clean_name(name))
        if tensor is not None:
            i = row[first[id(tensor)]]
            sums[i, :3] = _checksum(whole.to(tensor.dtype))
            sums[i, 6] = 1

    _whole_pass(model.config, mapping, files, mine, record)
    for name, i in row.items():
        sums[i, 3:6] = _local_checksum(tensors[name], world)
    if dist.get_backend() == "nccl":
        sums = sums.cuda()
    dist.all_reduce(sums, group=group)
    sums = sums.cpu()
    for name, (file_sum, file_weighted, size, loaded_sum, loaded_weighted, _, recorded) in zip(names, sums.tolist()):
        tolerance = 1e-9 * (size + 1)
        # Written so that NaN (uninitialised memory) fails too.
        if recorded and not (
            abs(loaded_sum - file_sum) <= tolerance and abs(loaded_weighted - file_weighted) <= tolerance
        ):
            raise ConfigError(
                "model.name_or_path",
                f"{name} as loaded differs from {path}'s (sum {loaded_sum:.6g}, in the file {file_sum:.6g}): this "
                "family's conversion is read wrong when sharded; the run would train on wrong weights",
                "nothing was trained; report it with the family's name (a loader bug, not your checkpoint's)",
            )


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, group: dist.ProcessGroup | None = None) -> None:
    """Fill the materialized model (checked first with check_weights) from the checkpoint in path, then verify
    every tensor (a collective of `group`: the ranks that hold the model, by default every rank)."""
    mapping, files = _mapping(model), checkpoint_files(path)
    with ExitStack() as handles:
        targets = _targets(model, mapping, _slices(files, handles, meta=True).keys())
    # A pipeline stage's model holds some of the checkpoint's tensors: the others' conversions are not its own.
    held = _tensors(model)
    whole = {k for k, (target, safe) in targets.items() if not safe and clean_name(target) in held}
    # transformers sets each loaded tensor as a new Parameter; FSDP2 owns the parameter objects it sharded, so
    # each value is copied into the original, which goes back in its place.
    originals = list(_registered(model))
    with ExitStack() as handles:
        state = {k: v for k, v in _slices(files, handles, meta=False).items() if k not in whole}
        _load(model, mapping, state, str(next(model.parameters()).device))
    for module, name, original in originals:
        loaded = module._parameters[name]
        if loaded is not original:
            target = local_shard(original)
            target.copy_(local_shard(loaded))
            module._parameters[name] = original
    tensors = _tensors(model)

    def keep(name: str, full: torch.Tensor) -> None:
        target = tensors[clean_name(name)]
        local = local_shard(target)
        if isinstance(target, DTensor):
            # src_data_rank=None: every rank has the whole tensor and slices its own, no communication.
            full = distribute_tensor(
                full.to(local.device, local.dtype), target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
        local.copy_(full)

    _whole_pass(model.config, mapping, files, whole, keep)
    verify_loaded(model, path, mapping, files, targets, group)
