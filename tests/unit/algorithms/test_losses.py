import pytest
import torch

from vapo_megatron.algorithms.losses import (
    aggregate,
    entropy_bonus,
    explained_variance,
    explained_variance_stats,
    policy_loss,
    positive_nll_loss,
    value_loss,
)

pytestmark = pytest.mark.unit


def test_clip_higher_bounds_and_gradients():
    # ratios 0.7, 0.9, 1.1, 1.25, 1.35 with positive and negative advantages.
    ratios = torch.tensor([0.7, 0.9, 1.1, 1.25, 1.35, 0.7, 1.35], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    old = torch.zeros(7, dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    mask = torch.ones(7)
    loss, m = policy_loss(
        logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="token-mean", num_tokens=7
    )
    expected = torch.tensor([-0.7, -0.9, -1.1, -1.25, -1.28, 0.8, 1.35], dtype=torch.float64)
    assert loss.item() == pytest.approx(expected.sum().item() / 7)
    loss.backward()
    # Gradient is zero exactly where the clipped branch is active: ratio 1.35 with A > 0
    # (above 1.28) and ratio 0.7 with A < 0 (below 0.8).
    active = logp.grad != 0
    assert active.tolist() == [True, True, True, True, False, False, True]
    assert m["clip_frac_high"].item() == pytest.approx(1 / 7)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 7)
    # With the symmetric 0.2 clip, ratio 1.25 is clipped too.
    loss_sym, m_sym = policy_loss(
        ratios.log(),
        old,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token-mean",
        num_tokens=7,
    )
    assert m_sym["clip_frac_high"].item() == pytest.approx(2 / 7)
    assert loss_sym.item() > loss.item()


def test_dual_clip_bounds_negative_advantages():
    logp = torch.tensor([2.0]).log()
    loss, m = policy_loss(
        logp, torch.zeros(1), torch.tensor([-1.0]), torch.ones(1),
        eps_low=0.2, eps_high=0.2, aggregation="token-mean", num_tokens=1, dual_clip=3.0,
    )  # fmt: skip
    assert loss.item() == pytest.approx(2.0)  # below the bound 3
    logp = torch.tensor([5.0]).log()
    loss, m = policy_loss(
        logp, torch.zeros(1), torch.tensor([-1.0]), torch.ones(1),
        eps_low=0.2, eps_high=0.2, aggregation="token-mean", num_tokens=1, dual_clip=3.0,
    )  # fmt: skip
    assert loss.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(
            logp,
            logp,
            logp,
            logp,
            eps_low=0.2,
            eps_high=0.2,
            aggregation="token-mean",
            num_tokens=1,
            dual_clip=0.5,
        )


def test_aggregation_modes_by_hand():
    # Two sequences: lengths 1 and 3 (padded to 3); per-token losses.
    per_token = torch.tensor([[4.0, 9.0, 9.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    seq_len = torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]])
    assert aggregate(per_token, mask, "token-mean", num_tokens=4).item() == pytest.approx(10 / 4)
    got = aggregate(
        per_token, mask, "seq-mean-token-mean", num_tokens=4, num_seqs=2, seq_num_tokens=seq_len
    )
    assert got.item() == pytest.approx((4 + 2) / 2)
    assert aggregate(
        per_token, mask, "seq-mean-token-sum", num_tokens=4, num_seqs=2
    ).item() == pytest.approx(5)
    with pytest.raises(ValueError, match="num_seqs"):
        aggregate(per_token, mask, "seq-mean-token-mean", num_tokens=4)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, mask, "mean", num_tokens=4, num_seqs=2)


def test_value_loss_and_clipping():
    values = torch.tensor([1.0, 2.0, 0.0], requires_grad=True)
    returns = torch.tensor([0.0, 0.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])
    loss, _ = value_loss(values, returns, mask, num_tokens=2)
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    old = torch.tensor([0.0, 2.5, 0.0])
    loss, m = value_loss(values, returns, mask, num_tokens=2, old_values=old, clip=0.2)
    # token 0: clipped value 0.2 -> (0.2)^2 < 1, keep 1; token 1: clipped 2.3 -> 5.29 > 4.
    assert loss.item() == pytest.approx(0.5 * (1 + 2.3**2) / 2)
    assert m["value_clip_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, returns, mask, num_tokens=2, clip=0.2)


def test_positive_nll_normalised_by_positive_tokens():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    positive = torch.tensor([[1, 1, 1], [0, 0, 0]])
    loss, _ = positive_nll_loss(logp, mask, positive, num_positive_tokens=2)
    assert loss.item() == pytest.approx(1.5)
    loss, _ = positive_nll_loss(logp, mask, torch.zeros_like(positive), num_positive_tokens=0)
    assert loss.item() == 0.0


def test_entropy_share():
    mean, m = entropy_bonus(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]), num_tokens=2)
    assert mean.item() == 2.0 and m["entropy"].item() == 2.0


def test_explained_variance_from_summed_shards():
    gen = torch.Generator().manual_seed(0)
    returns = torch.randn(50, generator=gen)
    values = returns + 0.3 * torch.randn(50, generator=gen)
    mask = torch.rand(50, generator=gen) > 0.2
    r, v = returns[mask].double(), values[mask].double()
    expected = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    whole = explained_variance(explained_variance_stats(returns, values, mask))
    shards = sum(
        explained_variance_stats(returns[i::3], values[i::3], mask[i::3]) for i in range(3)
    )
    assert whole.item() == pytest.approx(expected.item(), rel=1e-9)
    assert explained_variance(shards).item() == pytest.approx(expected.item(), rel=1e-9)
    assert torch.isnan(
        explained_variance(explained_variance_stats(torch.ones(4), torch.zeros(4), torch.ones(4)))
    )


@pytest.mark.parametrize("num_tokens", [100_000, 1_000_003])
@pytest.mark.parametrize("num_off", [1, 3, 10])
def test_explained_variance_of_constant_returns_is_nan(num_tokens, num_off):
    # Every reward 1 under lambda = gamma = 1: float32 returns are 1.0, a few tokens one ulp
    # off (float32 GAE arithmetic), values 1 +- 1e-4. Var(R) is then rounding noise (~1e-20);
    # computed from sums it used to give EV ~ -9e7 here instead of "undefined".
    gen = torch.Generator().manual_seed(num_off)
    returns = torch.ones(num_tokens)
    off = torch.randint(0, num_tokens, (num_off,), generator=gen)
    one = torch.tensor(1.0)
    up, down = torch.nextafter(one, torch.tensor(2.0)), torch.nextafter(one, torch.tensor(0.0))
    returns[off] = torch.where(torch.rand(num_off, generator=gen) > 0.5, up, down)
    values = 1 + 1e-4 * torch.randn(num_tokens, generator=gen)
    mask = torch.ones(num_tokens, dtype=torch.bool)
    stats = explained_variance_stats(returns, values, mask)
    assert stats.dtype == torch.float64
    assert torch.isnan(explained_variance(stats))
    # Exactly constant returns, and no response tokens at all: NaN too.
    assert torch.isnan(
        explained_variance(explained_variance_stats(torch.ones(9), values[:9], mask[:9]))
    )
    assert torch.isnan(explained_variance(explained_variance_stats(returns, values, ~mask)))


def test_explained_variance_keeps_small_but_real_variance():
    # Returns 1 + 1e-3 * noise (relative variance 1e-6, far above rounding) still give an EV.
    gen = torch.Generator().manual_seed(1)
    returns = 1 + 1e-3 * torch.randn(10_000, generator=gen)
    values = returns + 1e-4 * torch.randn(10_000, generator=gen)
    mask = torch.ones(10_000)
    ev = explained_variance(explained_variance_stats(returns, values, mask)).item()
    assert ev == pytest.approx(0.99, abs=2e-3)
