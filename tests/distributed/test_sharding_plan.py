"""The sharding plan is data: which modules become FSDP units, each with its reshard flag. (a) The plan each
config asks for; (b) on 2 real processes, the trained model's FSDP units and what stays gathered after a
forward are exactly that plan."""

import pytest

from fsdp_research.config.schema import Strategy
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.train.startup import mesh_line
from tests.conftest import FAST
from tests.helpers.dist import ok, train_distributed
from tests.helpers.fsdp_units import observe_units, plan_for

pytestmark = pytest.mark.distributed

BLOCKS = [f"model.layers.{i}" for i in range(4)]  # llama_tiny
LINEARS = [
    f"{block}.{linear}"
    for block in BLOCKS
    for linear in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]
# FSDP2 never reshards the root after forward: backward needs its parameters at once.
ROOT = [("", False)]
BLOCKWISE = [(block, True) for block in BLOCKS[:-1]] + [(BLOCKS[-1], False)] + ROOT
EXPECTED = {
    "blockwise": BLOCKWISE,
    "hsdp": BLOCKWISE,
    "reshard_all": [(block, True) for block in BLOCKS] + ROOT,
    "no_reshard": [(block, False) for block in BLOCKS] + ROOT,
    "root_only": ROOT,
    "per_linear": [(linear, True) for linear in LINEARS] + ROOT,
    # A shard group of one rank: nothing to reshard.
    "ddp": [(block, False) for block in BLOCKS] + ROOT,
    "ddp_classic": [],
}
# Hydra adds keys to a dict-typed field only with `+` (a plain `key={...}` is refused in struct mode).
OVERRIDE = "+sharding.reshard_override={0:false,3:true}"


def _units(plan):
    return [(unit.path, unit.reshard_after_forward) for unit in plan.units]


@pytest.mark.parametrize("strategy", list(EXPECTED))
def test_plan_of_each_strategy(strategy):
    plan = plan_for(compose([f"sharding={strategy}"]))
    assert plan.strategy is Strategy[strategy]
    assert _units(plan) == EXPECTED[strategy]


def test_reshard_override_wins_over_the_strategy():
    plan = plan_for(compose([OVERRIDE]))
    assert _units(plan) == [(BLOCKS[0], False), (BLOCKS[1], True), (BLOCKS[2], True), (BLOCKS[3], True)] + ROOT


@pytest.mark.parametrize("index", [4, -1])
def test_reshard_override_out_of_range(index):
    with pytest.raises(ConfigError, match=r"^sharding\.reshard_override: block .* fix: use indices 0\.\.3"):
        plan_for(compose([f"+sharding.reshard_override={{{index}:true}}"]))


def test_activation_checkpointing_keeps_the_plan():
    """The wrapped blocks take the blocks' places: same paths, same flags."""
    assert _units(plan_for(compose(["activation_checkpointing=every_block"]))) == BLOCKWISE


@pytest.mark.parametrize(
    ("overrides", "world", "line"),
    [
        (["sharding=hsdp", "sharding.replicate=2"], 4, "mesh: dp_replicate 2 x dp_shard 2"),
        (["sharding=ddp"], 2, "mesh: dp_replicate 2 x dp_shard 1"),
        (
            ["sharding=hsdp", "sharding.replicate=2", "parallel.tp=2"],
            8,
            "mesh: dp_replicate 2 x dp_shard 2 x tp 2 (ranks 0-1 share a tp group)",
        ),
        ([], 4, None),  # FSDP's one dimension: the model's line says it
    ],
)
def test_the_mesh_line_of_each_mesh_of_more_than_one_dimension(overrides, world, line):
    """The start-up log's `mesh:` line (hsdp logged none: only tp, ep and cp did)."""
    assert mesh_line(compose(overrides), world) == line


ONE_STEP = FAST + ["trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2"]
APPLIED = {
    "blockwise": [],
    "no_reshard": ["sharding=no_reshard"],
    "reshard_all": ["sharding=reshard_all"],
    "root_only": ["sharding=root_only"],
    "per_linear": ["sharding=per_linear"],
    "hsdp": ["sharding=hsdp"],
    "override": [OVERRIDE],
    "ac_every_block": ["activation_checkpointing=every_block"],
    "ac_every_2nd": ["activation_checkpointing=every_2nd"],
    "ddp": ["sharding=ddp"],
    "ddp_classic": ["sharding=ddp_classic"],
}


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    configs = {name: compose(ONE_STEP + extra) for name, extra in APPLIED.items()}
    observed = train_distributed(configs, 2, str(tmp_path_factory.mktemp("plans")), inspect=observe_units)
    return {name: (plan_for(configs[name]), observed) for name in APPLIED}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(APPLIED))
def test_applied_plan_matches(applied, name):
    plan, observed = applied[name]
    observed = ok(observed, name)
    assert sorted(observed["units"]) == sorted(unit.path for unit in plan.units)
    if not plan.units:  # ddp_classic
        return
    # Between steps every unit is sharded; after a forward, exactly the units that do not reshard are gathered.
    assert observed["gathered_before_forward"] == []
    assert observed["gathered_after_forward"] == sorted(u.path for u in plan.units if not u.reshard_after_forward)
    stride = {"ac_every_block": 1, "ac_every_2nd": 2}.get(name)
    for i, block in enumerate(BLOCKS):
        if block in observed["units"]:
            # With activation checkpointing, FSDP shards the wrapper, which sits at the block's path.
            wrapped = stride is not None and i % stride == 0
            assert observed["units"][block] == ("FSDPCheckpointWrapper" if wrapped else "FSDPLlamaDecoderLayer")
