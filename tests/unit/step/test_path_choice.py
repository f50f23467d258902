"""Which data path a step takes (``outputs.choose_path``: nothing per token crosses ranks, or
the critic's advantages are routed), and which samples a DP rank owns (``step_share``). The
routed step against a single-rank reference: tests/distributed/step/test_shard_path.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from vapo_megatron.config.layout import ModelLayout, layout_sizes
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.step.outputs import choose_path
from vapo_megatron.step.scoring_pass import step_share

pytestmark = pytest.mark.unit
RECIPES = Path(__file__).resolve().parents[3] / "recipes"


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def engine(layout: ModelLayout, world: int, rank: int = 0):
    """What choose_path reads of a ModelEngine: its layout and this rank's coordinates."""
    sizes = layout_sizes(tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world)
    groups = SimpleNamespace(
        tp_rank=rank % layout.tp, pp_rank=0, cp_rank=0, dp_rank=0, tp_size=layout.tp,
        pp_size=layout.pp, cp_size=layout.cp,
    )  # fmt: skip
    return SimpleNamespace(layout=layout, dp_size=sizes["dp"], groups=groups)


@pytest.mark.parametrize(
    "recipe,world", [("vapo_qwen2.5_32b.yaml", 128), ("vapo_qwen2.5_7b.yaml", 8)]
)
def test_the_paper_recipes_route_nothing_per_token(recipe, world):
    config = load_recipe(RECIPES / recipe)
    policy = engine(config.policy.layout, world)
    critic = engine(config.critic.layout, world)
    choice = choose_path([policy, critic], host_group=None)
    assert choice.name == "shards", choice.reason


def test_differing_layouts_route_and_say_why():
    config = load_recipe(RECIPES / "tiny_cpu.yaml")
    engines = [engine(config.policy.layout, 2), engine(config.critic.layout, 2)]
    choice = choose_path(engines, host_group=None)
    assert choice.name == "routed" and "differ" in choice.reason
    assert "policy dp=1, critic dp=2" in choice.reason
    # One model alone (critic pretraining, GRPO) always has one layout.
    assert choose_path(engines[1:], host_group=None).name == "shards"


def test_cp_with_pp_needs_no_other_path():
    layout = ModelLayout(pp=2, cp=2)
    choice = choose_path([engine(layout, 8), engine(layout, 8)], host_group=None)
    assert choice.name == "shards", choice.reason


def test_step_share_owns_each_sample_once_balanced_per_minibatch():
    counts = [5, 9, 2, 7, 7, 3, 8, 1]
    lengths = torch.tensor([c - 1 for c in counts])
    parts = [torch.tensor([3, 0, 6, 1]), torch.tensor([2, 7, 5, 4])]
    shares = [step_share(parts, counts, lengths, dp_size=2, dp_rank=r) for r in range(2)]
    ids = [s.ids.tolist() for s in shares]
    assert sorted(ids[0] + ids[1]) == list(range(8))
    for part in parts:  # each mini-batch split by tokens
        loads = [sum(counts[i] for i in s.mine(part.tolist(), r)) for r, s in enumerate(shares)]
        assert abs(loads[0] - loads[1]) <= max(counts[i] for i in part.tolist())
    for share in shares:  # local buffers: this rank's samples' response tokens end to end
        starts = [share.start[i] for i in share.ids.tolist()]
        assert starts == [
            sum(int(lengths[j]) for j in share.ids.tolist()[:k]) for k in range(len(starts))
        ]
        assert share.num_tokens == int(lengths[share.ids].sum())
    owner_start = [int(shares[r].owner_start[i]) for i in range(8) for r in [shares[0].owners[i]]]
    assert owner_start == [shares[shares[0].owners[i]].start[i] for i in range(8)]
