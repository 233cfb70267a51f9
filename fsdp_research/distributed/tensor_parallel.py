"""Tensor parallel (parallel.tp): the family's own plan (transformers' base_model_tp_plan: module pattern ->
colwise, rowwise, ...), with parallel.tp_plan over it, as torch's ParallelStyles on the tp dimension of the mesh,
applied before fully_shard shards the same parameters over the data-parallel dimensions. Attention splits by heads
(the colwise q/k/v give each rank its heads; transformers' attention reshapes by -1 heads), the MLP by its inner
size; embeddings, the final norm and the head stay whole on every tp rank (a tied head stays tied).

Sequence parallel (parallel.sequence_parallel) keeps the blocks' residual stream split along the sequence: each
block's norms run on sequence shards (torch's SequenceParallel), its attention and MLP gather their input, and its
output projections reduce-scatter instead of all-reducing; the first block splits its input and the last gathers
its output, so that what runs outside the blocks (embedding, masks, rotary tables, final norm, head) sees whole
tensors."""

import re

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_research.config.schema import ParallelConfig
from fsdp_research.distributed.names import clean_name
from fsdp_research.errors import ConfigError

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")


def sequence_parallel(cfg: ParallelConfig) -> bool:
    return cfg.tp > 1 and cfg.sequence_parallel is not False


def tp_plan(model: nn.Module, cfg: ParallelConfig) -> dict[str, str]:
    """Module path (as named_modules, wrappers left out) -> style: the family's plan with parallel.tp_plan over it
    ("none" drops a module). Raises ConfigError for a family without a plan, a style not known here, or a pattern
    naming no module."""
    config = getattr(model, "config", None)
    family = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan = {**family, **cfg.tp_plan}
    if not family and not cfg.tp_plan:
        raise ConfigError(
            "parallel.tp",
            f"{type(model).__name__} has no tensor-parallel plan (base_model_tp_plan)",
            "give one as parallel.tp_plan={'layers.*.mlp.up_proj': colwise, ...}, or use parallel.tp=1",
        )
    odd = {p: s for p, s in plan.items() if s not in (*STYLES, "none")}
    if odd:
        pattern, style = next(iter(odd.items()))
        key = "parallel.tp_plan" if pattern in cfg.tp_plan else "parallel.tp"
        raise ConfigError(
            key,
            f"{pattern}: style {style!r} is not supported here (only {', '.join(STYLES)})",
            f"override it in parallel.tp_plan (e.g. {pattern}: none), or use parallel.tp=1",
        )
    prefix = getattr(model, "base_model_prefix", "")
    base = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    paths = [clean_name(name) for name, _ in model.named_modules()]
    found = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(base + pattern).replace(r"\*", r"[^.]+"))
        matched = [p for p in paths if regex.fullmatch(p)]
        if not matched and pattern in cfg.tp_plan:
            raise ConfigError("parallel.tp_plan", f"{pattern} names no module of {type(model).__name__}", "fix it")
        found.update({p: style for p in matched if style != "none"})
    return found


def check_divisible(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Each split Linear's split dimension divides by tp (heads and KV heads with it: their projections' widths)."""
    modules = {clean_name(name): m for name, m in model.named_modules()}
    for path, style in plan.items():
        module = modules[path]
        if not isinstance(module, nn.Linear):
            raise ConfigError("parallel.tp", f"{path} is a {type(module).__name__}, not a Linear", "use parallel.tp=1")
        size = module.out_features if style.startswith("colwise") else module.in_features
        if size % tp:
            raise ConfigError(
                "parallel.tp", f"{tp} does not divide {path}'s split size {size}", "use a tp that divides it"
            )
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError("parallel.tp", f"{tp} does not divide the model's {key} ({heads})", "use a divisor")


def _style(style: str, sp: bool) -> ParallelStyle:
    # Under sequence parallel the output projections hand the residual stream back split along the sequence.
    out = {"output_layouts": Shard(1), "use_local_output": False} if sp else {}
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(**out),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), **out),
    }[style]()


def _gathered(x):
    return x.redistribute(placements=[Replicate()]).to_local() if isinstance(x, DTensor) else x


def _gather_inputs(module, args, kwargs):
    return tuple(_gathered(a) for a in args), {k: _gathered(v) for k, v in kwargs.items()}


def _gather_output(module, args, output):
    """The last block's output gathered whole, as a copy rather than to_local's view: FSDP2 warns of a unit that
    returns a view ("can cause backward to fail or produce wrong gradients"), since an in-place op on it (in the
    family's code after the blocks: the final norm) would drop the unit's pre-backward hook. The tp tests prove
    the view harmless only for the families they run; one activation's copy per micro-batch makes it so for all."""
    if isinstance(output, tuple):
        return (_gathered(output[0]).clone(), *output[1:])
    return _gathered(output).clone()


def keep_rank_streams(mesh: DeviceMesh) -> None:
    """DTensor's RNG tracker, made without its state sync: made by the first random op on a DTensor, it would copy
    rank 0's generator to every rank, so every data-parallel rank would draw rank 0's dropout masks; without it each
    rank keeps its own stream (fsdp_research.train.randomness seeds them). CUDA only: the tracker runs on no CPU."""
    from torch.distributed.tensor import _random

    if mesh.device_type != "cpu" and _random._rng_tracker is None:
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


def apply_tp(model: nn.Module, blocks: list[str], mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """The plan's styles on `mesh` (the tp dimension), the model still on the meta device; with sequence parallel,
    the blocks' norms too and the hooks that split and gather the residual stream."""
    keep_rank_streams(mesh)
    sp = sequence_parallel(cfg)
    plan = tp_plan(model, cfg)
    paths = {clean_name(name): name for name, _ in model.named_modules()}
    styles = {paths[p]: _style(s, sp) for p, s in plan.items()}
    if sp:
        real = {id(m): name for name, m in model.named_modules()}
        for block_path in blocks:
            block = model.get_submodule(block_path)
            # An activation-checkpointed block's sublayers are its wrapped module's.
            for child in getattr(block, "_checkpoint_wrapped_module", block).children():
                inside = f"{clean_name(real[id(child)])}."
                if any(p.startswith(inside) for p in plan):
                    child.register_forward_pre_hook(_gather_inputs, with_kwargs=True)
                elif "norm" in type(child).__name__.lower():
                    styles[real[id(child)]] = SequenceParallel()

        def split_input(module, args, kwargs):
            def split(x):
                return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])

            if args:
                return (split(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}

        model.get_submodule(blocks[0]).register_forward_pre_hook(split_input, with_kwargs=True)
        model.get_submodule(blocks[-1]).register_forward_hook(_gather_output)
    parallelize_module(model, mesh, styles)
