"""What a constructor or an init does to a parameter, recorded once at full size on the meta device (no memory, no
draws) as a recipe (model.recipes), which is replayed on any of its rows: a rank builds only the rows of its shard.

The recorder sees torch.nn.init's elementwise draws, fills, copies and in-place arithmetic on a parameter (a torch
function mode), each as a write on the region of rows it touched. A write it cannot replay exactly (orthogonal_, a
value read back, a view across rows) raises Unsupported: the caller then builds at full size, never on a guess."""

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_research.model.recipes import CHUNK, Recipe, Unsupported, Write, row_size, whole_write

# torch.nn.init's elementwise functions (replayed as such: trunc_normal_ is a no-op on the meta device) and the
# shape-dependent ones that end in an elementwise draw (recorded as that draw, its spread from the full shape).
_INIT = {"uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_"}
_SHAPED = {"kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"}
_METHODS = {
    *("normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_"),
    *("zero_", "fill_", "copy_", "masked_fill_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_"),
    *("mul_", "add_", "sub_", "div_", "exp_", "log_", "sqrt_", "abs_", "neg_", "pow_"),
    *("__iadd__", "__isub__", "__imul__", "__itruediv__"),
}
_FACTORIES = {torch.empty: None, torch.zeros: ("fill_", 0.0), torch.ones: ("fill_", 1.0)}
_FACTORIES |= {torch.randn: ("normal_",), torch.rand: ("uniform_",)}


def _overlaps(dims, strides) -> bool:
    """Whether two elements of the view share a place (a stride-0 expand, an as_strided overlap)."""
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(dims, strides) if n > 1):
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def _region(view: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, int], tuple, bool]:
    """Which rows of a parameter of `shape` and `dtype` the view covers, and where in each row."""
    size, offset = row_size(shape), view.storage_offset()
    dims, strides = tuple(view.shape), tuple(view.stride())
    extent = sum((n - 1) * s for n, s in zip(dims, strides) if n > 0)
    if view.dtype != dtype:
        raise Unsupported(f"a {view.dtype} view of a {dtype} parameter")
    if size == 0 or any(s < 0 for s in strides) or _overlaps(dims, strides):
        raise Unsupported("a view with negative or overlapping strides, or of an empty row")
    if len(shape) >= 1 and len(dims) == len(shape) and (dims[0] == 1 or strides[0] == size):
        inner = (dims[1:], strides[1:], offset % size)
        if inner[2] + sum((n - 1) * s for n, s in zip(dims[1:], strides[1:]) if n > 0) < size:
            first = offset // size
            return (first, first + dims[0]), inner, True
    if offset // size == (offset + extent) // size:
        first = offset // size
        return (first, first + 1), (dims, strides, offset % size), False
    raise Unsupported(f"a view of shape {list(dims)} across rows of a {list(shape)} parameter")


class _Bases:
    """The meta tensors being recorded, by storage (views of one share it)."""

    def __init__(self):
        self.recipes: dict[int, tuple[torch.Tensor, Recipe]] = {}

    def add(self, tensor: torch.Tensor) -> Recipe:
        recipe = Recipe(tuple(tensor.shape))
        self.recipes[tensor.untyped_storage()._cdata] = (tensor, recipe)  # the tensor kept: its storage not reused
        return recipe

    def of(self, tensor) -> Recipe | None:
        """The recipe of the recorded tensor whose storage `tensor` shares (a view of it, or itself)."""
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            found = self.recipes.get(tensor.untyped_storage()._cdata)
            return found[1] if found else None
        return None

    def base(self, tensor) -> torch.Tensor | None:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            found = self.recipes.get(tensor.untyped_storage()._cdata)
            return found[0] if found else None
        return None

    def refuse(self, tensor, reason: str) -> Unsupported:
        """The error for a write into `tensor` that cannot be recorded, noted on its recipe for good."""
        recipe = self.of(tensor)
        if recipe is not None and recipe.failed is None:
            recipe.failed = reason
        return Unsupported(reason)


class _WriteGuard(TorchDispatchMode):
    """Every aten write to a recorded tensor must come from a write the recorder saw; and a value read back from
    the meta device (what code that catches the error would replace by a guess) is noted."""

    def __init__(self, bases: _Bases):
        super().__init__()
        self.bases, self.allowed, self.read_back = bases, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            self.read_back = True
        if not self.allowed:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    if self.bases.of(value) is not None:
                        raise self.bases.refuse(value, f"{func} writes a parameter")
        return func(*args, **kwargs)


class Recorder(TorchFunctionMode):
    """Records the writes to the tensors added to it (used through `recording`); with factories=True, a float32
    factory call of more than `large` elements makes a recorded meta tensor (its fill the recipe's first write).
    `read_back`: some code read a value of the meta device (and may have caught the error)."""

    def __init__(self, factories: bool = False, large: int = CHUNK):
        super().__init__()
        self.bases, self.factories, self.large = _Bases(), factories, large
        self.guard = _WriteGuard(self.bases)

    def add(self, tensor: torch.Tensor) -> Recipe:
        return self.bases.add(tensor)

    @property
    def read_back(self) -> bool:
        return self.guard.read_back

    def recipe(self, tensor: torch.Tensor) -> Recipe | None:
        """The recipe of a recorded tensor itself (None for a view of one: its rows are not the recipe's)."""
        base = self.bases.base(tensor)
        same = base is not None and tensor.shape == base.shape and tensor.stride() == base.stride()
        return self.bases.of(tensor) if same and tensor.storage_offset() == 0 and tensor.dtype == base.dtype else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.factories and func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if not any(self.bases.of(t) is not None for t in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        name, module = getattr(func, "__name__", ""), getattr(func, "__module__", "")
        # torch.nn.init hands its arguments over by name.
        first, rest, named = (args[0], args[1:], kwargs) if args else (kwargs.get("tensor"), (), kwargs)
        if not args:
            named = {k: v for k, v in kwargs.items() if k != "tensor"}
        if module == "torch.nn.init" and name in _SHAPED:
            draw, bounds = _shaped(func, args, kwargs)
            return self._write(draw, self.bases.of(first), first, bounds, {}, lambda: first)
        target = self.bases.of(first)
        if func is torch.Tensor.__setitem__:
            view = args[0][args[1]]
            if self.bases.of(view) is None:  # advanced indexing: a copy, not a view
                raise self.bases.refuse(args[0], "an indexed write that is not a view")
            fill = torch.Tensor.copy_ if isinstance(args[2], torch.Tensor) else torch.Tensor.fill_
            return self._write(fill, self.bases.of(view), view, (args[2],), {}, lambda: func(*args, **kwargs))
        if target is not None and (name in _METHODS or (module == "torch.nn.init" and name in _INIT)):
            return self._write(func, target, first, rest, named, lambda: func(*args, **kwargs))
        mutates = name.endswith("_") and not name.startswith("__") and name != "requires_grad_"
        if mutates or "out" in kwargs or func == torch.Tensor.data.__set__:
            tracked = next(t for t in tree_flatten((args, kwargs))[0] if self.bases.of(t) is not None)
            raise self.bases.refuse(tracked, f"{name or func} on a parameter")
        return func(*args, **kwargs)  # a read: its result is meta, and a write of it raises above

    def _factory(self, func, args, kwargs):
        size = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args)
        dims = [int(d) for d in size] if all(isinstance(d, int) for d in size) else None
        # float32 only: replay draws in float32.
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        if (
            dims is None
            or math.prod(dims) <= self.large
            or dtype != torch.float32
            or "out" in kwargs
            or kwargs.get("device") not in (None, "cpu", torch.device("cpu"))
        ):
            return func(*args, **kwargs)
        tensor = func(*args, **{**kwargs, "device": "meta"})
        recipe = self.bases.add(tensor)
        if _FACTORIES[func] is not None:
            fill, *values = _FACTORIES[func]
            recipe.writes.append(whole_write(getattr(torch.Tensor, fill), tuple(dims), tuple(values)))
        return tensor

    def _write(self, func, recipe: Recipe | None, view: torch.Tensor, args: tuple, kwargs: dict, run):
        if recipe is None:
            raise Unsupported(f"{func.__name__} of a parameter into another tensor")
        try:
            rows, inner, row_dim = _region(view, recipe.shape, self.bases.base(view).dtype)
        except Unsupported as why:
            raise self.bases.refuse(view, str(why)) from None
        sliced = []
        for i, arg in enumerate(args):
            if not isinstance(arg, torch.Tensor):
                continue
            if arg.is_meta:
                raise self.bases.refuse(view, f"{func.__name__} of a value computed from a parameter")
            # A tensor of the region's rows is cut to the rows replayed; one broadcast over them is kept whole.
            if row_dim and arg.dim() == view.dim() and arg.shape[0] == view.shape[0] > 1:
                sliced.append(i)
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise self.bases.refuse(view, f"{func.__name__} with a tensor passed by name")
        self.guard.allowed += 1
        try:
            result = run()
        finally:
            self.guard.allowed -= 1
        versions = tuple((a, a._version) for a in args if isinstance(a, torch.Tensor))
        recipe.writes.append(Write(func, rows, inner, row_dim, tuple(args), dict(kwargs), tuple(sliced), versions))
        return result


def _shaped(func, args, kwargs) -> tuple:
    """The draw a kaiming_/xavier_ init makes, its spread from the full shape (what a chunk's shape would not give)."""
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    given, init = bound.arguments, torch.nn.init
    if func.__name__.startswith("kaiming"):
        fan = init._calculate_correct_fan(given["tensor"], given["mode"])
        std = init.calculate_gain(given["nonlinearity"], given["a"]) / math.sqrt(fan)
    else:
        fan_in, fan_out = init._calculate_fan_in_and_fan_out(given["tensor"])
        std = given["gain"] * math.sqrt(2.0 / (fan_in + fan_out))
    if func.__name__.endswith("uniform_"):
        return torch.Tensor.uniform_, (-math.sqrt(3.0) * std, math.sqrt(3.0) * std)
    return torch.Tensor.normal_, (0.0, std)


# torch.nn.init functions that return at once on the meta device and are not seen by a TorchFunctionMode: while
# recording, each name bound to one of them anywhere (modules import them by name) is a wrapper that records it
# (trunc_normal_, elementwise) or refuses (orthogonal_, eye_, dirac_, sparse_: not row by row).
_SHORTCUTS = ("trunc_normal_", "orthogonal_", "eye_", "dirac_", "sparse_")
_ACTIVE: list[Recorder] = []
_bound: tuple[int, list] = (0, [])


def _wrapper(original):
    @functools.wraps(original)
    def wrapped(tensor, *args, **kwargs):
        recorder = _ACTIVE[-1] if _ACTIVE else None
        recipe = recorder.bases.of(tensor) if recorder else None
        if recipe is None:
            return original(tensor, *args, **kwargs)
        if original.__name__ != "trunc_normal_":
            raise recorder.bases.refuse(tensor, f"{original.__name__} is not elementwise")
        return recorder._write(original, recipe, tensor, args, kwargs, lambda: tensor)

    return wrapped


def _bindings() -> list:
    """Where the shortcut functions are bound: (namespace, name, original), looked up again as modules load."""
    global _bound
    if _bound[0] != len(sys.modules):
        originals = {id(getattr(torch.nn.init, n)): getattr(torch.nn.init, n) for n in _SHORTCUTS}
        found = []
        for module in list(sys.modules.values()):
            space = getattr(module, "__dict__", None)
            for key, value in list(space.items()) if isinstance(space, dict) else ():
                if id(value) in originals and value is originals[id(value)]:
                    found.append((space, key, value))
                elif key == "TORCH_INIT_FUNCTIONS" and type(value) is dict:  # transformers' table of them
                    found += [(value, k, v) for k, v in value.items() if id(v) in originals]
        _bound = (len(sys.modules), found)
    return _bound[1]


@contextlib.contextmanager
def recording(factories: bool = False, large: int = CHUNK) -> Iterator[Recorder]:
    recorder, bindings = Recorder(factories, large), _bindings()
    for space, key, original in bindings:
        space[key] = _wrapper(original)
    _ACTIVE.append(recorder)
    try:
        with recorder.guard, recorder:
            yield recorder
    finally:
        _ACTIVE.pop()
        for space, key, original in bindings:
            space[key] = original
