"""Hydra's `_target_` plug-ins (optimizers, schedules, losses, callbacks, models), resolved and checked before any
compute: a target that does not import names its module and attribute, a keyword its signature rejects is named.
Partial semantics: the framework passes its own arguments (parameter groups, an optimizer) at call time."""

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fsdp_research.errors import ConfigError

# Keys Hydra's instantiate reads: never passed on as keyword arguments.
_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def resolve(path: str, key: str) -> Any:
    """The object at a dotted path (module, then attributes: `pkg.mod.Class`, `pkg.mod.Class.method`)."""
    parts = str(path).split(".")
    module, error = None, None
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
            break
        except ModuleNotFoundError as err:
            # Only a missing module of the path itself means "try a shorter one"; a missing import inside it is
            # the user's bug, said as such.
            if err.name is None or not ".".join(parts[:cut]).startswith(err.name):
                raise ConfigError(key, f"importing {path!r} failed: {err}", f"install {err.name!r}") from None
            error = err
        except Exception as err:  # the user's module raised while importing
            raise ConfigError(key, f"importing {'.'.join(parts[:cut])!r} raised {err!r}", "fix that module") from None
    if module is None:
        raise ConfigError(
            key,
            f"cannot import {path!r} ({error})",
            "pip install the package that holds it, or put its directory on PYTHONPATH",
        )
    obj = module
    for depth, attribute in enumerate(parts[cut:], cut):
        if not hasattr(obj, attribute):
            raise ConfigError(
                key,
                f"module {'.'.join(parts[:depth])!r} has no attribute {attribute!r}",
                f"check the spelling of {path!r}",
            )
        obj = getattr(obj, attribute)
    return obj


def kwargs_of(node: Mapping | DictConfig | None, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config node's keyword arguments for its target: plain containers, without Hydra's and the framework's
    keys."""
    if node is None:
        return {}
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return {k: v for k, v in plain.items() if k not in _HYDRA_KEYS and k not in exclude}


def check_call(target: Callable, kwargs: Mapping[str, Any], key: str, *given: str) -> None:
    """Whether target(<given positional names>, **kwargs) binds: a keyword its signature does not take is named."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: the call itself will say
        return
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    names = [n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in names and not accepts_any]
    if unknown:
        raise ConfigError(
            f"{key.rsplit('._target_', 1)[0]}.{unknown[0]}",
            f"{getattr(target, '__qualname__', target)} takes no argument {unknown[0]!r}",
            f"remove it (~{key.rsplit('._target_', 1)[0]}.{unknown[0]}) or use one of: {', '.join(names)}",
        )
    try:
        signature.bind_partial(*given, **kwargs)
    except TypeError as err:
        raise ConfigError(key, f"{getattr(target, '__qualname__', target)}: {err}", "fix its arguments") from None


def named_in(target: Callable, values: Mapping[str, Any], or_any: bool = False) -> dict[str, Any]:
    """The values whose names target's signature lists (the framework's own keys that a plug-in may take);
    or_any: all of them where it takes **kwargs."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: all, where it may take any (the call says)
        return dict(values) if or_any else {}
    if or_any and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(values)
    return {k: v for k, v in values.items() if k in params}


def build(node: DictConfig, key: str, *args: Any, exclude: tuple[str, ...] = ()) -> Any:
    """node._target_(*args, **its other keys), checked first."""
    target = resolve(node._target_, key)
    kwargs = kwargs_of(node, exclude)
    check_call(target, kwargs, key, *(f"arg{i}" for i in range(len(args))))
    return target(*args, **kwargs)
