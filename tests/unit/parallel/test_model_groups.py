"""Per-model layouts: rank groups follow megatron's default order; impossible sizes are refused
before any process group is touched; schedule settings are checked."""

import pytest
from megatron.core.parallel_state import RankGenerator

from vapo_megatron.config.layout import ModelLayout, check_layout_pair, layout_sizes
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.parallel.model_groups import build_model_groups, rank_groups

pytestmark = pytest.mark.unit
KINDS = [("tp",), ("cp",), ("dp",), ("pp",), ("cp", "dp"), ("tp", "cp"), ("tp", "pp"),
         ("tp", "cp", "dp")]  # fmt: skip


@pytest.mark.parametrize("tp,pp,cp,world", [(2, 1, 1, 4), (1, 2, 1, 4), (2, 2, 1, 4),
                                            (1, 1, 2, 4), (2, 2, 2, 16), (2, 1, 2, 8)])  # fmt: skip
def test_rank_groups_equal_megatrons_default_order(tp, pp, cp, world):
    sizes = layout_sizes(tp=tp, pp=pp, cp=cp, world_size=world)
    megatron = RankGenerator(tp=tp, ep=1, dp=sizes["dp"], pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for kind in KINDS:
        want = sorted(tuple(r) for r in megatron.get_ranks("-".join(kind)))
        assert rank_groups(sizes, *kind) == want, kind
    assert rank_groups(sizes) == [(r,) for r in range(world)]


def test_sizes_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ValueError, match=r"tp \* pp \* cp = 3 \* 1 \* 1 = 3 does not divide the 4"):
        build_model_groups(tp=3, pp=1, cp=1, world_size=4)  # before any torch.distributed call
    with pytest.raises(ValueError, match="critic layout: .* does not divide the 4 ranks"):
        check_layout_pair(ModelLayout(tp=2), ModelLayout(tp=2, pp=3), 4)
    check_layout_pair(ModelLayout(tp=2, pp=2), ModelLayout(cp=2), 4)
    assert layout_sizes(tp=2, pp=2, cp=1, world_size=8)["dp"] == 2


def test_schedule_settings_are_checked():
    with pytest.raises(ValueError, match="needs lr_decay_steps > lr_warmup_steps"):
        OptimSettings(lr_decay_style="cosine", lr_warmup_steps=10)
    with pytest.raises(ValueError, match="0 <= min_lr <= lr"):
        OptimSettings(lr=1e-6, min_lr=1e-5)
    with pytest.raises(ValueError, match="lr_decay_style must be"):
        OptimSettings(lr_decay_style="WSD")
    OptimSettings(lr_decay_style="linear", lr_warmup_steps=5, lr_decay_steps=100)
