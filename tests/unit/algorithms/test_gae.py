import math

import pytest
import torch

from vapo_megatron.algorithms import gae as gae_module
from vapo_megatron.algorithms.advantages import (
    decoupled_gae_packed,
    decoupled_gae_padded,
    gae_lambdas,
)
from vapo_megatron.algorithms.gae import (
    gae_packed,
    gae_padded,
    length_adaptive_lambda,
    reverse_discounted_cumsum,
)
from vapo_megatron.algorithms.presets import algo_preset

pytestmark = pytest.mark.unit


def textbook_gae(rewards, values, mask, lams, gamma):
    """The reverse loop over time steps, one sequence at a time, in Python floats."""
    batch, length = rewards.shape
    advantages = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        next_value, running = 0.0, 0.0
        for t in reversed(range(length)):
            if not mask[b, t]:
                continue
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * float(lams[b]) * running
            advantages[b, t] = running
            next_value = float(values[b, t])
    return advantages


def random_batch(batch, length, seed, gaps):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    if gaps:
        mask = torch.rand(batch, length, generator=gen) > 0.3
    else:  # prompt, response, padding
        pos = torch.arange(length)[None]
        start = torch.randint(0, length // 2 + 1, (batch, 1), generator=gen)
        stop = start + torch.randint(0, length // 2 + 1, (batch, 1), generator=gen)
        mask = (pos >= start) & (pos < stop)
    lams = torch.rand(batch, generator=gen, dtype=torch.float64)
    lams[0], lams[1 % batch] = 0.0, 1.0
    # Rewards on every response token (harder than VAPO's last-token reward), none off it.
    return rewards * mask, values, mask, lams


def test_paper_numbers():
    lam = length_adaptive_lambda(torch.tensor([100, 1000, 20, 10, 1, 0]), alpha=0.05)
    assert lam[0].item() == pytest.approx(0.8, abs=1e-12)
    assert lam[1].item() == pytest.approx(0.98, abs=1e-12)
    assert lam[2:].tolist() == [0.0, 0.0, 0.0, 0.0]
    # A reward 100 tokens ahead reaches the first token weighted by 0.95**100 (gamma = 1, V = 0).
    rewards = torch.zeros(1, 101, dtype=torch.float64)
    rewards[0, -1] = 1.0
    adv, _ = gae_padded(
        rewards, torch.zeros_like(rewards), torch.ones(1, 101, dtype=torch.bool), 0.95
    )
    assert f"{adv[0, 0].item():.5g}" == "0.0059205"


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.93])
@pytest.mark.parametrize("length", [1, 7, 16, 300, 1000])
def test_padded_matches_textbook_loop(gaps, gamma, length):
    rewards, values, mask, lams = random_batch(6, length, seed=length, gaps=gaps)
    adv, ret = gae_padded(rewards, values, mask, lams, gamma)
    ref = textbook_gae(rewards, values, mask, lams, gamma)
    torch.testing.assert_close(adv, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, (ref + values) * mask, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("gaps", [False, True])
def test_packed_matches_padded(gaps):
    rewards, values, mask, lams = random_batch(7, 90, seed=3, gaps=gaps)
    lengths = torch.tensor([90, 0, 13, 90, 1, 45, 30])
    flat = [torch.cat([x[b, : lengths[b]] for b in range(7)]) for x in (rewards, values, mask)]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    adv, ret = gae_packed(*flat, cu, lams, 0.97)
    cut = torch.arange(90)[None] < lengths[:, None]
    ref_adv, ref_ret = gae_padded(rewards * cut, values, mask & cut, lams, 0.97)
    torch.testing.assert_close(adv, ref_adv[cut], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ret, ref_ret[cut], atol=1e-12, rtol=1e-12)


def test_lambda_gamma_one_returns_are_reward_to_go():
    rewards, values, mask, _ = random_batch(5, 200, seed=9, gaps=True)
    _, ret = gae_padded(rewards, values, mask, 1.0, 1.0)
    to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1]) * mask
    torch.testing.assert_close(ret, to_go, atol=1e-10, rtol=1e-10)


def test_lambda_zero_gives_td_errors():
    rewards, values, mask, _ = random_batch(4, 50, seed=2, gaps=False)
    adv, _ = gae_padded(rewards, values, mask, 0.0, 0.9)
    next_v = torch.nn.functional.pad((values * mask)[:, 1:], (0, 1))
    torch.testing.assert_close(
        adv, (rewards + 0.9 * next_v - values) * mask, atol=1e-12, rtol=1e-12
    )


def test_stable_at_32k_tokens_float32():
    length = 32768
    rewards = torch.zeros(2, length)
    rewards[:, -1] = 1.0
    values = torch.rand(2, length)
    mask = torch.ones(2, length, dtype=torch.bool)
    lams = torch.tensor([1.0, 0.9999])
    adv, ret = gae_padded(rewards, values, mask, lams, 1.0)
    assert torch.isfinite(adv).all()
    assert torch.equal(ret[0], torch.ones(length))  # lambda = 1: every return is the final reward
    ref = textbook_gae(rewards[1:].double(), values[1:].double(), mask[1:], lams[1:].double(), 1.0)
    torch.testing.assert_close(adv[1:].double(), ref, atol=2e-4, rtol=1e-4)


def test_reverse_discounted_cumsum_edges():
    x = torch.randn(3, 100, dtype=torch.float64)
    coef = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    y = reverse_discounted_cumsum(x, coef)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y[1], torch.flip(torch.cumsum(torch.flip(x[1], [0]), 0), [0]))
    assert reverse_discounted_cumsum(torch.zeros(2, 0), torch.ones(2)).shape == (2, 0)


def test_chunk_size_does_not_change_results(monkeypatch):
    rewards, values, mask, lams = random_batch(3, 500, seed=5, gaps=False)
    ref, _ = gae_padded(rewards, values, mask, lams, 1.0)
    for chunk in (2, 5, 64):
        monkeypatch.setattr(gae_module, "CHUNK", chunk)
        adv, _ = gae_padded(rewards, values, mask, lams, 1.0)
        torch.testing.assert_close(adv, ref, atol=1e-11, rtol=1e-11)


def test_bad_inputs_raise():
    r = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
        gae_padded(r, torch.zeros(2, 4), torch.ones(2, 5), 0.9)
    with pytest.raises(ValueError, match="lam must lie in"):
        gae_padded(r, r, torch.ones(2, 5), 1.5)
    with pytest.raises(ValueError, match="one value per sequence"):
        gae_padded(r, r, torch.ones(2, 5), torch.ones(3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        gae_packed(torch.zeros(5), torch.zeros(5), torch.ones(5), torch.tensor([0, 3]), 0.9)
    with pytest.raises(ValueError, match="alpha"):
        length_adaptive_lambda(torch.tensor([5]), 0.0)


def test_decoupled_gae_uses_two_lambdas():
    cfg = algo_preset("vapo")
    rewards, values, mask, _ = random_batch(4, 120, seed=11, gaps=False)
    adv, ret, lam_policy = decoupled_gae_padded(cfg, rewards, values, mask)
    lengths = mask.sum(1)
    assert torch.equal(lam_policy, length_adaptive_lambda(lengths, 0.05))
    ref_adv = textbook_gae(rewards, values, mask, lam_policy, 1.0)
    ref_ret = textbook_gae(rewards, values, mask, torch.ones(4, dtype=torch.float64), 1.0) + values
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, ref_ret * mask, atol=1e-10, rtol=1e-10)
    # Packed gives the same numbers.
    cu = torch.arange(5) * 120
    adv_p, ret_p, _ = decoupled_gae_packed(
        cfg, rewards.reshape(-1), values.reshape(-1), mask.reshape(-1), cu
    )
    torch.testing.assert_close(adv_p, adv.reshape(-1))
    torch.testing.assert_close(ret_p, ret.reshape(-1))
    # Without decoupling, the critic uses the policy's lambda.
    lam_p, lam_c = gae_lambdas(algo_preset("vapo_without_decoupled_gae"), lengths)
    assert torch.equal(lam_p, lam_c)
    lam_p, lam_c = gae_lambdas(algo_preset("ppo"), lengths)
    assert lam_p.tolist() == lam_c.tolist() == [0.95] * 4
    assert math.isclose(float(gae_lambdas(cfg, lengths)[1][0]), 1.0)


def test_reward_off_the_response_raises():
    # The off-by-one DESIGN.md warns about: the reward one position after the last response
    # token (on padding) would be dropped without a trace.
    rewards = torch.zeros(3, 8)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[:, 2:5] = True
    rewards[:, 4] = 1.0  # right: the last response token
    gae_padded(rewards, torch.zeros(3, 8), mask, 1.0)
    rewards[1, 5] = rewards[2, 5] = 1.0  # wrong: one past it
    with pytest.raises(ValueError, match=r"2 nonzero reward\(s\).*\(1, 5\).*last response token"):
        gae_padded(rewards, torch.zeros(3, 8), mask, 1.0)
    with pytest.raises(ValueError, match=r"2 nonzero reward\(s\).*packed token 13"):
        gae_packed(
            rewards.reshape(-1),
            torch.zeros(24),
            mask.reshape(-1),
            torch.tensor([0, 8, 16, 24]),
            1.0,
        )
    cfg = algo_preset("vapo")
    with pytest.raises(ValueError, match="last response token"):
        decoupled_gae_padded(cfg, rewards, torch.zeros(3, 8), mask)
    # Padding rows with zero reward stay fine, even when the mask is empty.
    gae_padded(torch.zeros(2, 4), torch.randn(2, 4), torch.zeros(2, 4, dtype=torch.bool), 0.9)


def test_reward_off_the_response_raises_under_cp():
    from vapo_megatron.parallel.cp_gae import gae_context_parallel, gae_context_parallel_packed

    rewards, mask = torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :3] = True
    rewards[0, 3] = 1.0
    with pytest.raises(ValueError, match=r"1 nonzero reward\(s\).*CP shard \(0, 3\)"):
        gae_context_parallel(rewards, torch.zeros(2, 8), mask, 1.0, 1.0, None)
    with pytest.raises(ValueError, match=r"packed CP shard 3"):
        gae_context_parallel_packed(
            rewards.reshape(-1), torch.zeros(16), mask.reshape(-1), torch.tensor([0, 8, 16]),
            1.0, 1.0, None,
        )  # fmt: skip


def textbook_packed(rewards, values, mask, cu, lams, gamma):
    """The textbook loop on each packed sequence separately."""
    out = torch.zeros(rewards.numel(), dtype=torch.float64)
    for s in range(cu.numel() - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        if hi > lo:
            out[lo:hi] = textbook_gae(
                rewards[None, lo:hi], values[None, lo:hi], mask[None, lo:hi], lams[s : s + 1], gamma
            )[0]
    return out


@pytest.mark.parametrize("block", [1 << 22, 7, 100])
@pytest.mark.parametrize("scan_chunk", [2, 3, 64])
@pytest.mark.parametrize("gaps", [False, True])
def test_packed_scan_matches_textbook_loop_per_sequence(monkeypatch, scan_chunk, gaps, block):
    # Lengths 0, 1, around the chunk size, and one long sequence: scans cut at every boundary,
    # and small chunks force several levels of the chunk-start recursion; small blocks split
    # the step into blocks of whole sequences (one sequence longer than a block included).
    monkeypatch.setattr(gae_module, "SCAN_CHUNK", scan_chunk)
    monkeypatch.setattr(gae_module, "GAE_BLOCK_TOKENS", block)
    gen = torch.Generator().manual_seed(scan_chunk)
    lengths = torch.tensor([0, 1, 2, 3, 63, 64, 65, 0, 700, 5, 128, 1])
    num_tokens = int(lengths.sum())
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    values = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    mask = (
        torch.rand(num_tokens, generator=gen) > 0.3
        if gaps
        else torch.ones(num_tokens, dtype=torch.bool)
    )
    rewards = torch.randn(num_tokens, generator=gen, dtype=torch.float64) * mask
    lams = torch.rand(lengths.numel(), generator=gen, dtype=torch.float64)
    lams[4], lams[8] = 0.0, 1.0
    for gamma in (1.0, 0.9):
        adv, ret = gae_packed(rewards, values, mask, cu, lams, gamma)
        ref = textbook_packed(rewards, values, mask, cu, lams, gamma)
        torch.testing.assert_close(adv, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ret, (ref + values) * mask, atol=1e-10, rtol=1e-10)


def test_segmented_reverse_cumsum_matches_loop(monkeypatch):
    monkeypatch.setattr(gae_module, "SCAN_CHUNK", 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 203, generator=gen, dtype=torch.float64)
    coef = torch.rand(2, 203, generator=gen, dtype=torch.float64)
    coef[:, ::17] = 0.0
    coef[1, 50:90] = 1.0
    ref = torch.zeros_like(x)
    running = torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(203)):
        running = x[:, t] + (coef[:, t] * running if t + 1 < 203 else 0)
        ref[:, t] = running
    torch.testing.assert_close(gae_module.segmented_reverse_cumsum(x, coef), ref)
    empty = gae_module.segmented_reverse_cumsum(torch.zeros(2, 0), torch.zeros(2, 0))
    assert empty.shape == (2, 0)


class LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the largest number of elements of any tensor a torch call returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        return out


def test_packed_gae_does_not_pad_to_the_longest_sequence():
    # One 20,000-token sequence among 200 short ones: padding every sequence to the longest
    # would build 201 x 20,000 = 4M-element buffers for 21,000 tokens.
    lengths = torch.tensor([20_000] + [5] * 200)
    num_tokens = int(lengths.sum())
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    rewards = torch.zeros(num_tokens)
    rewards[cu[1:] - 1] = 1.0
    values = torch.rand(num_tokens)
    for mask in (torch.ones(num_tokens, dtype=torch.bool), values > 0.1):
        with LargestTensor() as seen:
            decoupled_gae_packed(algo_preset("vapo"), rewards * mask, values, mask, cu)
        assert seen.largest <= 3 * num_tokens, seen.largest


@pytest.mark.parametrize("mean_length", [3, 500])
def test_per_token_coefficients_both_ways(mean_length):
    # Short sequences take repeat_interleave, long ones the slice fill: same result.
    gen = torch.Generator().manual_seed(mean_length)
    lengths = torch.randint(0, 2 * mean_length, (40,), generator=gen)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    per_seq = torch.rand(2, 40, generator=gen)
    expected = torch.repeat_interleave(per_seq, lengths, dim=1)
    assert torch.equal(gae_module._per_token(per_seq, cu), expected)


def test_packed_gae_scans_in_blocks_of_whole_sequences(monkeypatch):
    # 100 sequences of 100 tokens with 1,000-token blocks: no scan sees more than a block (plus
    # the sequence that crosses its end), so the temporaries stay a block's size.
    monkeypatch.setattr(gae_module, "GAE_BLOCK_TOKENS", 1000)
    widths = []
    scan = gae_module.segmented_reverse_cumsum

    def recording(x, coef):
        widths.append(x.shape[1])
        return scan(x, coef)

    monkeypatch.setattr(gae_module, "segmented_reverse_cumsum", recording)
    cu = torch.arange(101) * 100
    rewards = torch.zeros(10_000, dtype=torch.float64)
    rewards[cu[1:] - 1] = 1.0
    values = torch.rand(10_000, dtype=torch.float64)
    mask = torch.ones(10_000, dtype=torch.bool)
    lams = torch.rand(100, dtype=torch.float64)
    adv, _ = gae_packed(rewards, values, mask, cu, lams, 0.99)
    assert widths and max(widths) <= 1100, widths
    ref = textbook_packed(rewards, values, mask, cu, lams, 0.99)
    torch.testing.assert_close(adv, ref, atol=1e-10, rtol=1e-10)
