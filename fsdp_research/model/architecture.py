"""Models without allocating them: a Hugging Face causal LM from its config, or any model a factory builds
(model._target_), on the meta device, and its repeating blocks (dimensions: fsdp_research.model.dimensions)."""

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.nn as nn
from omegaconf import OmegaConf
from torch.nn.modules.module import register_module_module_registration_hook

from fsdp_research.config.schema import ModelConfig
from fsdp_research.config.targets import build as build_target
from fsdp_research.errors import ConfigError
from fsdp_research.model.recipes import Recipe, Unsupported
from fsdp_research.model.recorded_init import Recorder, recording

# model's own keys: with model._target_ the others are the factory's keyword arguments.
OWN_KEYS = ("name", "name_or_path", "model_type", "config", "load_weights", "block_class", "moe", "lora")

log = logging.getLogger("fsdp_research")


def build_hf_config(cfg: ModelConfig):
    """transformers' config of the model; None for a model of one's own (model._target_)."""
    from transformers import AutoConfig

    if cfg.get("_target_"):
        _check_own_model(cfg)
        return None
    unknown = sorted(set(cfg.keys()) - {*OWN_KEYS, "_target_"})
    if unknown:
        raise ConfigError(
            f"model.{unknown[0]}",
            "is not a key of a transformers model (only a model._target_ factory takes other keys)",
            "remove it, or put the family's config values under model.config",
        )
    if not (cfg.name_or_path or cfg.model_type):
        raise ConfigError(
            "model.model_type",
            "neither model.name_or_path nor model.model_type is set",
            "pick a model option (model=llama_tiny) or set model.name_or_path",
        )
    path = str(cfg.name_or_path or "")
    # A hub id is <org>/<name>: anything else with a slash, or starting like a path, is a directory.
    if path and not os.path.isdir(path) and (path.startswith((".", "~", os.sep)) or path.count("/") > 1):
        raise ConfigError(
            "model.name_or_path", f"{path} does not exist", "give a directory written by save_pretrained, or a hub id"
        )
    # Plain values: transformers' configs check their nested fields' types (rope_parameters must be a dict).
    values = OmegaConf.to_container(cfg.config, resolve=True) if OmegaConf.is_config(cfg.config) else dict(cfg.config)
    try:
        if cfg.name_or_path:
            return AutoConfig.from_pretrained(cfg.name_or_path, **values)
        return AutoConfig.for_model(cfg.model_type, **values)
    except (OSError, ValueError, KeyError) as err:
        key = "model.name_or_path" if cfg.name_or_path else "model.model_type"
        raise ConfigError(
            key,
            f"transformers has no config for it ({_first_line(err)})",
            "use a local directory written by save_pretrained, or a model_type transformers knows",
        ) from None


def _check_own_model(cfg: ModelConfig) -> None:
    given = [k for k in ("name_or_path", "model_type") if cfg.get(k)] + (["config"] if cfg.config else [])
    if given:
        raise ConfigError(
            "model._target_",
            f"is set together with model.{given[0]} (a transformers model)",
            "use a model option of your own (_target_ and block_class alone), or drop model._target_",
        )
    if cfg.load_weights:
        raise ConfigError("model.load_weights", "a model._target_ factory loads its own weights", "set it to false")
    if not cfg.block_class:
        raise ConfigError(
            "model.block_class", "is not set for a model._target_ factory", "name its repeating block's class"
        )


# A parameter up to this size (vectors, small tables) keeps the values its module's constructor gave it; a larger
# one is made on the meta device, with a recipe of what its constructor wrote (model.recorded_init), or, where
# that cannot be recorded, made for real and noted by the mean and spread of its values.
_KEPT_AS_BUILT = 2**16


def as_built(module: nn.Module, name: str) -> torch.Tensor | tuple[float, float] | Recipe | None:
    """What the module's constructor gave its parameter `name`: its values (a small parameter), or what the
    constructor wrote into it (a large one, built on the meta device), or, where that could not be recorded, the
    mean and std of its values: what initialisation starts from where the family's _init_weights leaves a
    parameter to its module (attention sinks, state-space A_log, GPT's Conv1D)."""
    return module.__dict__.get("_as_built", {}).get(name)


def _noted(param: torch.Tensor, keep_all: bool) -> torch.Tensor | tuple[float, float]:
    values = param.detach().float()
    if keep_all or values.numel() <= _KEPT_AS_BUILT:
        return values.clone()
    return values.mean().item(), values.std().item() if values.numel() > 1 else 0.0


def _meta(param: nn.Parameter) -> nn.Parameter:
    # Shared (tied) parameters stay one parameter: the real one notes its meta twin, and goes when unused.
    if not hasattr(param, "_on_meta"):
        param._on_meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    return param._on_meta


def _to_meta(module: nn.Module, keep_all: bool = False, recorder: Recorder | None = None) -> None:
    """Every parameter of the module on the meta device, with a note of what it held (keep_all: every value), or
    of what was written into it where it was built on the meta device (`recorder` recorded it)."""
    for m in module.modules():
        for name, param in m._parameters.items():
            if param is None:
                continue
            if not param.is_meta:
                m.__dict__.setdefault("_as_built", {})[name] = _noted(param, keep_all)
                m._parameters[name] = _meta(param)
            elif recorder is not None and recorder.recipe(param) is not None:
                # What the constructor wrote so far (a family's later init is the group init's to replay).
                with contextlib.suppress(Unsupported):
                    m.__dict__.setdefault("_as_built", {})[name] = recorder.recipe(param).settled()


@contextlib.contextmanager
def _parameters_on_meta(recorder: Recorder | None) -> Iterator:
    """Parameters go to the meta device once the module holding them is built (when it is registered in its
    parent: its constructor has finished), with a note of what they hold; buffers (rotary tables) stay real, so
    they need no recomputation after materialization. Only a module's own small parameters are real at a time
    (its children's went when they were registered in it); with a recorder, large ones are made on the meta
    device and what the constructor writes into them recorded."""
    handle = register_module_module_registration_hook(
        lambda parent, name, child: _to_meta(child, recorder=recorder) if child else None
    )
    try:
        yield
    finally:
        handle.remove()


def _built(hf_config, seed: int, recorder: Recorder | None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta(recorder), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        _to_meta(model, recorder=recorder)  # the root's own parameters
    return model


def _recorded(model: nn.Module) -> bool:
    """Every buffer real, and every parameter noted (one made on the meta device from a value computed from
    another is not: its recipe is unknown)."""
    return not any(b.is_meta for b in model.buffers()) and all(
        as_built(m, n) is not None for m in model.modules() for n, p in m._parameters.items() if p is not None
    )


def build_model(hf_config, seed: int = 0, values: bool = True) -> nn.Module:
    """The model with every parameter on the meta device: nothing is allocated or initialised yet. Built from
    `seed` (what constructors draw is the same on every rank), each module's parameters noted as built (what
    initialisation needs); values=False: shapes only (the planner, the checks before a launch), built on the meta
    device outright, which skips a large model's minute of constructor initialisation."""

    if not values:
        try:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
            model.config.use_cache = False
            return model
        except Exception:  # a constructor that needs real values: the full build below says what is wrong
            pass
    try:
        model = None
        try:
            with recording(factories=True, large=_KEPT_AS_BUILT) as recorder:
                model = _built(hf_config, seed, recorder)
        except Exception:  # a constructor that needs a large parameter's values: built for real below
            pass
        if model is None or recorder.read_back or not _recorded(model):
            model = _built(hf_config, seed, None)
    except (ValueError, TypeError, AttributeError, RuntimeError) as err:
        raise ConfigError(
            "model.config",
            f"transformers cannot build a causal LM of type {hf_config.model_type!r} from it ({_first_line(err)})",
            "fix the model.config values (the family's own config class lists them)",
        ) from None
    # A fixed, deterministic attention kernel (no padding here, so no mask is needed).
    model.config.use_cache = False
    return model


def build_own_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """A model of one's own (model._target_, its other keys the factory's keyword arguments), built whole on the
    CPU from `seed` as its factory builds it, every value noted as built (whatever and however its constructor
    initialises), then its parameters on the meta device: each rank later keeps its shards of those values. So
    one full copy of the model passes through each rank's host memory at the start."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = build_target(cfg, "model._target_", exclude=OWN_KEYS)
        except ConfigError:
            raise
        except Exception as err:  # the factory's own error, said in one line
            raise ConfigError(
                "model._target_", f"{cfg._target_} raised {_first_line(err)}", "fix the factory or its arguments"
            ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model._target_", f"{cfg._target_} returned a {type(model).__name__}, not an nn.Module", "return the model"
        )
    _to_meta(model, keep_all=True)
    return model


# Families whose layers call their parts outside the layer's forward: Reformer's reversible layers recompute
# attention and feed-forward inside their own backward, where only the parts' own FSDP hooks can gather them.
_PART_BLOCKS = {"reformer": "ReformerAttention,ChunkReformerFeedForward"}


def block_class_name(model: nn.Module, override: str | None) -> str:
    """model.block_class, else the classes of the decoder's layers: the longest nn.ModuleList whose modules are
    all of classes in _no_split_modules (several for a hybrid: attention and state-space layers), else, where the
    family declares none (or none it repeats), the longest nn.ModuleList of modules of one class. Several classes
    are joined by commas."""
    if override:
        return override
    if getattr(getattr(model, "config", None), "model_type", None) in _PART_BLOCKS:
        return _PART_BLOCKS[model.config.model_type]
    declared = set(getattr(model, "_no_split_modules", None) or [])
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]

    def classes(layers: nn.ModuleList) -> list[str]:
        return sorted({type(m).__name__ for m in layers})

    repeated = [m for m in lists if set(classes(m)) <= declared]
    if repeated:
        return ",".join(classes(max(repeated, key=len)))
    uniform = [m for m in lists if len(classes(m)) == 1]
    if not uniform:
        raise ConfigError(
            "model.block_class",
            f"{type(model).__name__} has no list of repeating blocks (nn.ModuleList) to shard by",
            "set model.block_class=<its block class name>",
        )
    name = classes(max(uniform, key=len))[0]
    log.info(f"model.block_class: {name}, from the model's structure (its longest list of identical modules)")
    return name


def find_blocks(model: nn.Module, class_names: str) -> list[nn.Module]:
    """The repeating transformer blocks (of any of the comma-separated classes), in forward order; a block inside
    another (Zamba's hybrid layer holds a Mamba layer) is part of it."""
    names = {n.strip() for n in class_names.split(",")}
    blocks, inner = [], set()
    for m in model.modules():
        if type(m).__name__ in names and id(m) not in inner:
            blocks.append(m)
            inner.update(id(sub) for sub in m.modules())
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            "model.block_class",
            f"{type(model).__name__} has no module of class {class_names}",
            f"use one of its classes: {', '.join(present)}",
        )
    return blocks


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def dropout_in(model: nn.Module) -> list[str]:
    """Where the model drops out at training time: its nn.Dropout modules with p > 0 and the config's dropout
    probabilities above 0 (attention's dropout is often a functional argument)."""
    settings = model.config.to_dict() if hasattr(model, "config") else {}
    config = {
        f"{k}={v}" for k, v in settings.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0
    }
    modules = {f"{type(m).__name__}(p={m.p})" for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0}
    return sorted(config) + sorted(modules)


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding: transformers' accessor, else a model's first nn.Embedding."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that makes the logits: transformers' accessor, else a model's last nn.Linear as wide as its token
    embedding is long (None where there is none: a head computed from the embedding's weight)."""
    if hasattr(model, "get_output_embeddings"):
        return model.get_output_embeddings()
    embedding = input_embedding(model)
    vocab = embedding.num_embeddings if embedding is not None else None
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


def pretrained_dir(name_or_path: str) -> str:
    """A local directory as is; a hub id through the local HF cache (downloaded only when asked for)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    return snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
