"""Weights out: one Hugging Face directory (config.json, model.safetensors, sharded with an index above a
size, the tokenizer when one is used) that AutoModelForCausalLM.from_pretrained loads; for a model of one's own
(model._target_), its state_dict as safetensors (model.safetensors, or shards and an index), the tokenizer beside.

At the end of training no rank gathers the model: the full tensors of each group (a block, or a module outside the
blocks) are gathered to the rank that owns it alone, one round of groups at a time; each rank writes its groups as
the family's save_pretrained does into files of its own, and then its share of the final shards, consolidated
from those files by byte copies (fsdp_research.checkpoint.consolidate). `fsdp-research export <step dir> <out dir>`
converts any resume checkpoint offline, in one process and with no GPU: the weights as they are, or a LoRA run's
adapters on its base as the run's end exports them."""

import contextlib
import copy
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_research.checkpoint.consolidate import INDEX, consolidate, write_index
from fsdp_research.checkpoint.resume import TRAINER_STATE
from fsdp_research.config.sizes import export_shard_size
from fsdp_research.data.chat import PROMPTS, chat_tokenizer, prompt_rendering
from fsdp_research.data.tokenizer import load_tokenizer
from fsdp_research.distributed.names import clean_name
from fsdp_research.distributed.pipeline import pipeline_of
from fsdp_research.distributed.precision import fp32_names, parse_dtype
from fsdp_research.distributed.processes import control_group
from fsdp_research.errors import CheckpointError
from fsdp_research.model.architecture import build_model, pretrained_dir
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.initialization import materialize
from fsdp_research.model.lora import ADAPTER_DIR, base_identity, base_view, export_adapter, init_adapters, merged
from fsdp_research.model.lora import enabled as lora_enabled
from fsdp_research.model.pretrained import load_pretrained

log = logging.getLogger("fsdp_research")


def export_dtype(cfg: DictConfig) -> torch.dtype:
    """checkpoint.export_dtype, by default the training's compute dtype."""
    return parse_dtype(cfg.checkpoint.export_dtype or cfg.precision.param_dtype, "checkpoint.export_dtype")


Writer = Callable[[dict[str, torch.Tensor], str], None]


def _hf_writer(hf_config, dtype: torch.dtype, shard_size: int) -> Writer:
    """write(state, out_dir): full weights as the family's save_pretrained writes them: its on-disk key names and
    layout (the reverse of its load-time conversions, experts one by one where the checkpoint format has them so),
    tied weights once, sharded with an index above shard_size. state may be some of the model's weights (a family's
    conversions between keys stay within a module)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    twin = build_model(hf_config, values=False)  # save_pretrained only needs the family's conventions
    # save_pretrained writes on rank 0 alone where a process group exists; here every rank writes its own part.
    twin.should_save_on_this_rank = lambda is_main_process: is_main_process
    twin.config.dtype = dtype
    tied = set(getattr(twin, "all_tied_weights_keys", None) or {})
    # What from_pretrained keeps in fp32 at this dtype (router gates) is written in fp32, as its save_pretrained does.
    fp32 = fp32_names(twin, dtype)

    def cast(name: str, value: torch.Tensor) -> torch.Tensor:
        return value.to(torch.float32 if fp32 and fp32.search(name) else dtype).contiguous()

    def write(state: dict[str, torch.Tensor], out_dir: str) -> None:
        tensors = {clean_name(k): cast(clean_name(k), v) for k, v in state.items() if clean_name(k) not in tied}
        twin.save_pretrained(out_dir, state_dict=tensors, max_shard_size=shard_size)

    return write


def untied(hf_config):
    """A copy of the config whose output head is its own weight, not the input embedding's."""
    config = copy.deepcopy(hf_config)
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        part.tie_word_embeddings = False
    return config


def write_hf_dir(
    state: dict[str, torch.Tensor],
    hf_config,
    out_dir: str,
    dtype: torch.dtype,
    shard_size: int,
    tokenizer: str | None = None,
) -> None:
    """Write full weights as the family's save_pretrained writes them (see _hf_writer), and the tokenizer."""
    _hf_writer(hf_config, dtype, shard_size)(state, out_dir)
    if tokenizer:
        load_tokenizer(tokenizer).save(out_dir)


def _state_writer(dtype: torch.dtype, shard_size: int) -> Writer:
    """write(state, out_dir) for a model of one's own: its state_dict (wrapper names stripped) in safetensors
    files, every name with its own copy (tied weights too), so that model.load_state_dict(load_file(...)) takes
    it whole."""
    return lambda state, out_dir: _write_state(state, out_dir, dtype, shard_size)


def write_state_dir(
    state: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype, shard_size: int, tokenizer: str | None = None
) -> None:
    """A model of one's own: its state_dict in safetensors files (see _state_writer), the tokenizer beside."""
    _write_state(state, out_dir, dtype, shard_size)
    if tokenizer:
        load_tokenizer(tokenizer).save(out_dir)


def _write_state(state: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype, shard_size: int) -> None:
    from huggingface_hub import save_torch_state_dict

    tensors, seen = {}, set()
    for name, value in state.items():
        value = value.to(dtype) if value.is_floating_point() else value
        key = (value.untyped_storage().data_ptr(), value.storage_offset())
        tensors[clean_name(name)] = value.clone() if key in seen else value
        seen.add(key)
    os.makedirs(out_dir, exist_ok=True)
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.WARNING)  # not its "Model weights successfully saved" line: the run says where
    try:
        save_torch_state_dict(tensors, out_dir, max_shard_size=shard_size)
    finally:
        hub_log.setLevel(level)


def _groups(model: torch.nn.Module, names: list[str]) -> list[list[str]]:
    """The export's units of work: each FSDP unit's own weights (a block), and each module's outside the units,
    in the state dict's order; one group of all where nothing is sharded (every rank holds the whole model)."""
    units = sorted(
        (clean_name(n) for n, m in model.named_modules() if n and isinstance(m, FSDPModule)), key=len, reverse=True
    )
    if not units:
        return [names]
    groups: dict[str, list[str]] = {}
    for name in names:
        clean = clean_name(name)
        unit = next((u for u in units if clean.startswith(f"{u}.")), clean.rpartition(".")[0])
        groups.setdefault(unit, []).append(name)
    return list(groups.values())


def _gather_to(value: torch.Tensor, owner: int, ranks: list[int], group=None) -> torch.Tensor | None:
    """The full tensor on rank `owner`, None on the other `ranks` (those holding the model: every rank, or a pipeline
    stage's, `group`; a collective of theirs). FSDP's layout (rows cut as torch.chunk cuts them, over every rank)
    goes to the owner alone, each rank sending its rows, padded to a chunk; so do other layouts where each rank holds
    a block of rows (FSDP's rows of tp's or ep's); any other (HSDP's replicas) is gathered by every rank."""
    if not isinstance(value, DTensor):
        return value if dist.get_rank() == owner else None
    mesh, world = value.device_mesh, len(ranks)
    if value.dim() == 0 or value.shape[0] == 0 or mesh.size() != world:
        return _everywhere(value, owner)
    in_order = mesh.mesh.flatten().tolist() == ranks  # the mesh's coordinate i is ranks[i]: alike on every rank
    if not (in_order and value.placements == (Shard(0),)):
        return _blocks_to(value, owner, group) if all(_rows(p) for p in value.placements) else _everywhere(value, owner)
    rows = value.shape[0]
    chunk = -(-rows // world)
    local = value.to_local()
    padded = torch.zeros((chunk, *value.shape[1:]), dtype=local.dtype, device=_device(mesh))
    padded[: local.shape[0]] = local
    if dist.get_rank() != owner:
        dist.gather(padded, None, dst=owner, group=mesh.get_group())
        return None
    full = padded.new_empty((chunk * world, *value.shape[1:]))  # each rank's rows land in place: no concatenation
    dist.gather(padded, list(full.split(chunk)), dst=owner, group=mesh.get_group())
    return full[:rows]


def _rows(placement) -> bool:
    """A placement that splits rows (FSDP's over tp's or ep's is a _StridedShard of dim 0)."""
    return isinstance(placement, Shard) and placement.dim == 0


def _device(mesh) -> torch.device | str:
    """The group's device: a shard offloaded to the CPU goes to the accelerator for NCCL."""
    kind = mesh.device_type
    return torch.device(kind, torch.get_device_module(kind).current_device()) if kind != "cpu" else "cpu"


def _everywhere(value: DTensor, owner: int) -> torch.Tensor | None:
    full = value.full_tensor()
    return full if dist.get_rank() == owner else None


def _blocks_to(value: DTensor, owner: int, group=None) -> torch.Tensor | None:
    """Each rank's block of rows (where it starts: its shard's global offset) to the owner, padded to the largest
    (among `group`'s ranks, by default every rank)."""
    local, device = value.to_local(), _device(value.device_mesh)
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    span = torch.tensor([offset[0], local.shape[0]], device=device)
    spans = [torch.empty_like(span) for _ in range(dist.get_world_size(group))]
    dist.all_gather(spans, span, group=group)
    spans = [tuple(s.tolist()) for s in spans]
    padded = torch.zeros((max(rows for _, rows in spans), *value.shape[1:]), dtype=local.dtype, device=device)
    padded[: local.shape[0]] = local
    if dist.get_rank() != owner:
        dist.gather(padded, None, dst=owner, group=group)
        return None
    received = [torch.empty_like(padded) for _ in spans]
    dist.gather(padded, received, dst=owner, group=group)
    full = padded.new_empty(value.shape)
    for (first, rows), part in zip(spans, received):
        full[first : first + rows] = part[:rows]
    return full


def write_parts(
    model: torch.nn.Module, hf_config, parts: str, dtype: torch.dtype, shard_size: int, replaced: dict | None = None
) -> None:
    """This rank's part of an export (a collective, every rank calls it): group i of the model's weights (or their
    `replaced` values) is gathered to rank i % world, which writes it into parts/<i>/, one round of world groups at
    a time. A pipeline stage's ranks do so among themselves, into parts/<stage>-<i>/; a tied weight, from the first
    stage alone."""
    inner = getattr(model, "module", model)
    state = {k: (replaced or {}).get(clean_name(k), v) for k, v in get_model_state_dict(inner).items()}
    pipeline, group, prefix = pipeline_of(inner), None, ""
    if pipeline is not None:
        group, prefix = pipeline.stage_group, f"{pipeline.stage:03d}-"
        if pipeline.last and pipeline.shared is not None:
            names = {clean_name(n) for n, p in inner.named_parameters(remove_duplicate=False) if p is pipeline.shared}
            state = {k: v for k, v in state.items() if clean_name(k) not in names}
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    write = _hf_writer(hf_config, dtype, shard_size) if hf_config is not None else _state_writer(dtype, shard_size)
    groups = _groups(inner, list(state))
    for first in range(0, len(groups), world):
        mine: dict[str, torch.Tensor] = {}
        for i in range(first, min(first + world, len(groups))):
            for name in groups[i]:  # every rank takes part in each gather; the group's owner gets the tensor
                full = _gather_to(state[name], ranks[i % world], ranks, group)
                if full is not None:
                    mine[name] = full.detach().cpu()
        if mine:
            write(mine, os.path.join(parts, f"{prefix}{first + rank:06d}"))
        del mine


def export_model(
    model: torch.nn.Module,
    hf_config,
    out_dir: str,
    dtype: torch.dtype,
    shard_size: int,
    tokenizer: str | None,
    replaced: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the weights as a Hugging Face directory (hf_config None: a model of one's own) from every rank, none
    holding more than a group at a time (a collective, every rank calls it): each rank's part into
    <out_dir>.parts/ (write_parts), the shards consolidated from those files by every rank, the index, config and
    tokenizer by rank 0. `replaced`: weights written instead of the model's, by name (laid out as those)."""
    rank, world, group = dist.get_rank(), dist.get_world_size(), control_group()
    parts = f"{os.path.normpath(out_dir)}.parts"
    if rank == 0:
        shutil.rmtree(parts, ignore_errors=True)
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # an earlier export's weights (its shards may be other ones)
            if name.endswith(".safetensors") or name == INDEX:
                os.remove(os.path.join(out_dir, name))
    dist.barrier(group=group)
    write_parts(model, hf_config, parts, dtype, shard_size, replaced)
    dist.barrier(group=group)
    files = [
        os.path.join(parts, d, f)
        for d in sorted(os.listdir(parts))
        for f in sorted(os.listdir(os.path.join(parts, d)))
        if f.endswith(".safetensors")
    ]
    shards = consolidate(files, out_dir, shard_size, rank, world)
    dist.barrier(group=group)
    if rank == 0:
        write_index(shards, out_dir)
        first_part = os.path.join(parts, sorted(os.listdir(parts))[0])
        for name in os.listdir(first_part):  # config.json, generation_config.json
            if not name.endswith(".safetensors") and name != INDEX:
                shutil.move(os.path.join(first_part, name), os.path.join(out_dir, name))
        if tokenizer:
            load_tokenizer(tokenizer).save(out_dir)
        shutil.rmtree(parts)
        log.info(f"exported the weights to {out_dir}")


def export_run(model: torch.nn.Module, cfg: DictConfig, hf_config, out_dir: str) -> None:
    """A run's model as it is now, as its export is written (checkpoint.export_dtype and export_shard_size, the
    data's tokenizer beside it; a collective: every rank calls it). With LoRA: the adapters in PEFT's format in
    <out_dir>/adapter, and the model with them merged (checkpoint.export_merged)."""
    shard_size = export_shard_size(cfg.checkpoint.export_shard_size)
    lora = lora_enabled(cfg.model.lora)
    if not lora or cfg.checkpoint.export_merged:
        with merged(model) if lora else contextlib.nullcontext({}) as apart:
            if apart:
                log.info(f"{', '.join(apart)}: adapted and tied to another module; the merged export unties them")
                hf_config = untied(hf_config)
            export_model(model, hf_config, out_dir, export_dtype(cfg), shard_size, cfg.data.tokenizer, apart)
    if lora:
        export_adapter(model, cfg.model, os.path.join(out_dir, ADAPTER_DIR))
    if dist.get_rank() == 0:
        write_prompting(cfg, out_dir)


def write_prompting(cfg: DictConfig, out_dir: str) -> None:
    """Into a run's export, what `generate` reads to prompt it as the run's samples did: prompts.json (the prompts'
    rendering, the data's tokenizer: `byte` has no files to save) and the run's tokenizer beside its LoRA adapter;
    with data.chat_template, the template the data was rendered with (not the tokenizer's own) beside the weights
    too."""
    with open(os.path.join(out_dir, PROMPTS), "w") as f:
        json.dump({"rendering": prompt_rendering(cfg.data), "tokenizer": cfg.data.tokenizer}, f)
    tok = chat_tokenizer(cfg.data) if cfg.data.chat_template else load_tokenizer(cfg.data.tokenizer).hf
    lora = lora_enabled(cfg.model.lora)
    places = ([out_dir] if cfg.data.chat_template else []) + ([os.path.join(out_dir, ADAPTER_DIR)] if lora else [])
    for where in places if tok is not None else []:
        tok.save_pretrained(where)


def load_checkpoint_weights(step_dir: str) -> dict[str, torch.Tensor]:
    """The full model weights of a resume checkpoint, read in this process alone."""
    metadata = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    state = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=step_dir, no_dist=True)
    return {k[len("model.") :]: v for k, v in state.items()}


def export_adapted(step_dir: str, cfg: DictConfig, hf_config, out_dir: str) -> None:
    """A LoRA run's checkpoint (its adapters alone) exported as the run's end exports it (export_run: the adapter,
    the merged model), in this process alone: the model built as the trainer builds it, unsharded, the base read
    from model.name_or_path, then the checkpoint's adapters; on a process group of this one process (the loading's
    checks and the export are collectives)."""
    base = cfg.model.name_or_path
    try:
        identity = base_identity(cfg.model)
    except (OSError, ValueError) as err:  # a directory gone, or a hub id not in the local cache
        raise CheckpointError(
            f"{step_dir}: cannot read the base its adapters trained on, {base} ({str(err).splitlines()[0]}); fix: "
            "put it back where the run's model.name_or_path names it"
        ) from None
    if identity != torch.load(os.path.join(step_dir, TRAINER_STATE), weights_only=False).get("base_weights"):
        raise CheckpointError(
            f"{step_dir}: {base} is not the base its adapters trained on (its weights changed); fix: put that base "
            "back there"
        )
    adapters = load_checkpoint_weights(step_dir)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = planned_model(cfg, hf_config)
        materialize(model, torch.device("cpu"), torch.device("cpu"))
        with base_view(model):
            load_pretrained(model, pretrained_dir(base))
        init_adapters(model, cfg.trainer.seed)  # the frozen originals of modules_to_save, as the trainer sets them
        params = {clean_name(name): p for name, p in model.named_parameters()}
        trained = {name for name, p in params.items() if p.requires_grad}
        if adapters.keys() != trained:  # a train_config.yaml changed since the save
            odd = sorted(adapters.keys() ^ trained)[0]
            raise CheckpointError(f"{step_dir}: its adapters are not those its train_config.yaml builds ({odd})")
        with torch.no_grad():
            for name, value in adapters.items():
                params[name].copy_(value)
        export_run(model, cfg, hf_config, out_dir)
    finally:
        dist.destroy_process_group()
