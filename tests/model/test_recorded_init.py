"""What model.recorded_init records and replays (initialisation by shard), in one process: any rows
replayed equal the same rows of the whole; the spread of torch's shape-dependent inits comes from the full
shape; and every write it cannot replay exactly refuses, even where the code that made it swallowed the error."""

import pytest
import torch
import torch.nn as nn

from fsdp_research.model.recipes import CHUNK, Recipe, Unsupported, replay
from fsdp_research.model.recorded_init import recording


def _recorded(shape, write) -> Recipe:
    """The recipe of a meta tensor of `shape` after write(tensor), settled (as initialization checks it)."""
    with recording() as recorder:
        tensor = nn.Parameter(torch.empty(shape, device="meta"))
        recipe = recorder.add(tensor)
        with torch.no_grad():
            write(tensor)
    if recorder.read_back:
        raise Unsupported("a value read back")
    return recipe.settled()


def test_any_rows_are_those_of_the_whole():
    def write(p):
        nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)
        p[:, :10].zero_()
        p[5] = 1.0
        p.mul_(2)

    rows = CHUNK // 300 * 3  # three chunks and a part
    recipe = _recorded((rows, 300), write)
    whole = replay(recipe, 0, rows, seed=7)
    assert recipe.covers() and not whole.isnan().any()
    for first, last in ((0, 1), (5, 6), (rows // 3 - 2, rows // 3 + 5), (rows - 9, rows)):
        assert torch.equal(replay(recipe, first, last, seed=7), whole[first:last])
    assert whole[:, :10].abs().sum() == 20 and whole[5].unique().tolist() == [2.0]
    drawn = torch.cat([whole[:5], whole[6:]])[:, 10:]
    assert drawn.abs().max() <= 0.08 and not torch.equal(whole[6], whole[7])


def test_shape_dependent_inits_draw_with_the_full_shapes_spread():
    recipe = _recorded((4096, 1024), lambda p: nn.init.kaiming_uniform_(p, a=5**0.5))  # nn.Linear's
    values = replay(recipe, 100, 200, seed=0)
    bound = 1 / 1024**0.5
    assert values.abs().max() <= bound and values.abs().max() > 0.99 * bound
    recipe = _recorded((4096, 1024), nn.init.xavier_normal_)
    assert replay(recipe, 0, 4096, seed=0).std().item() == pytest.approx((2 / (4096 + 1024)) ** 0.5, rel=0.01)


def _swallowed(p):
    nn.init.zeros_(p)
    try:
        nn.init.orthogonal_(p)
    except Exception:
        pass


def _read_back_swallowed(p):
    try:
        scale = p.abs().max().item()
    except Exception:
        scale = 1.0
    p.fill_(scale)


def _indexed_swallowed(p):
    p.zero_()
    try:
        p[[1, 3]] = 1.0
    except Exception:
        pass


def _copied_then_changed(p):
    source = torch.ones(p.shape)
    p.copy_(source)
    source.zero_()


@pytest.mark.parametrize(
    "write",
    [
        _swallowed,  # a refusal the caller caught still refuses
        _indexed_swallowed,  # an indexed write (a copy, not a view), its error caught
        _read_back_swallowed,  # a value read back from the meta device, its error caught
        _copied_then_changed,  # a tensor copied in, changed afterwards
        lambda p: nn.init.sparse_(p, 0.5),  # returns at once on the meta device
        lambda p: p[:, :1].expand(p.shape[0], 400).fill_(1.0),  # one place written many times
        lambda p: p[0, :200].view(torch.bfloat16).zero_(),  # a view of another dtype
        lambda p: p.add_(other=torch.ones(p.shape)),  # a tensor passed by name is not cut to the rows
        lambda p: p.copy_(p.t().t() * 2),  # a value computed from the parameter
    ],
    ids=[
        "swallowed",
        "indexed",
        "read-back",
        "changed-source",
        "sparse",
        "expanded",
        "dtype-view",
        "tensor-by-name",
        "computed",
    ],
)
def test_what_cannot_be_replayed_refuses(write):
    with pytest.raises(Unsupported):
        _recorded((600, 400), write)


def test_a_parameter_made_from_part_of_a_recorded_tensor_has_no_recipe():
    """Two parameters cut from one large factory tensor: neither is the recorded tensor itself."""
    with recording(factories=True, large=1000) as recorder:
        whole = torch.empty(1024, 256)
        with torch.no_grad():
            whole[:512].normal_()
            whole[512:].zero_()
        first, second = nn.Parameter(whole[:512]), nn.Parameter(whole[512:])
    assert whole.is_meta and recorder.recipe(whole) is not None
    assert recorder.recipe(first) is None and recorder.recipe(second) is None
