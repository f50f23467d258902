"""GAE with truncated importance traces (V-trace with lambda, issue 42) against the sum
formula written as a double loop, against today's GAE at ratios 1, and on simulated
context-parallel ranks.

    A_t = sum_{k>=t} gamma^(k-t) (prod_{i=t}^{k-1} lambda c_i) rho_k delta_k,
    rho_t = min(rho_bar, r_t), c_t = min(c_bar, r_t), returns_t = V_t + A_t.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.parallel.test_devices import DevicelessFactoryCalls
from vapo_megatron.algorithms import gae as gae_module
from vapo_megatron.algorithms.advantages import decoupled_gae_packed, decoupled_gae_padded
from vapo_megatron.algorithms.gae import gae_packed, gae_packed_lambdas, gae_padded
from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.parallel import cp_gae
from vapo_megatron.parallel.context_parallel import split_for_cp, split_packed_for_cp

pytestmark = pytest.mark.unit

LENGTHS = [0, 1, 2, 3, 63, 64, 65, 0, 200, 5, 130, 1]


def sum_formula(rewards, values, mask, cu, lams, gamma, ratios, rho_bar, c_bar):
    """A [N] float64 from the sum formula (not the recursion), per sequence, in Python floats:
    for each response token t, the sum over the response tokens k >= t of its sequence."""
    out = torch.zeros(rewards.numel(), dtype=torch.float64)
    for s in range(cu.numel() - 1):
        idx = [i for i in range(int(cu[s]), int(cu[s + 1])) if mask[i]]
        v = [float(values[i]) for i in idx] + [0.0]  # the value after the last token is 0
        delta = [float(rewards[i]) + gamma * v[j + 1] - v[j] for j, i in enumerate(idx)]
        rho = [min(rho_bar, float(ratios[i])) for i in idx]
        c = [min(c_bar, float(ratios[i])) for i in idx]
        lam = float(lams[s])
        for t in range(len(idx)):
            total, trace = 0.0, 1.0  # trace = prod_{i=t}^{k-1} lambda c_i, grown with k
            for k in range(t, len(idx)):
                total += gamma ** (k - t) * trace * rho[k] * delta[k]
                trace *= lam * c[k]
            out[idx[t]] = total
    return out


def packed_batch(seed, gaps, lengths=LENGTHS, dtype=torch.float64):
    """rewards, values, mask [N], cu [S + 1], lams [S] (0 and 1 included), ratios [N]: some
    0, some below 1, some above 1.5."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    num = int(cu[-1])
    if gaps:
        mask = torch.rand(num, generator=gen) > 0.3
    else:
        mask = torch.ones(num, dtype=torch.bool)
    rewards = (torch.randn(num, generator=gen, dtype=torch.float64) * mask).to(dtype)
    values = torch.randn(num, generator=gen, dtype=torch.float64).to(dtype)
    lams = torch.rand(lengths.numel(), generator=gen, dtype=torch.float64)
    lams[::4], lams[1::4] = 0.0, 1.0
    ratios = torch.exp(0.6 * torch.randn(num, generator=gen, dtype=torch.float64)).to(dtype)
    ratios[::37] = 0.0
    return rewards, values, mask, cu, lams, ratios


# ----- (1) ratios of 1 are today's GAE -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_unit_ratios_are_todays_gae_bit_for_bit(dtype, gaps, gamma):
    # Rows that today's code scans (gamma * lambda < 1 on some sequence; here lambda 0, 1 and
    # random per sequence) take the very same scan with c_t = rho_t = 1: multiplying by 1.0
    # changes no bit.
    rewards, values, mask, cu, lams, _ = packed_batch(3, gaps, dtype=dtype)
    ones = torch.ones(rewards.numel(), dtype=dtype)
    rows = torch.stack([lams, lams.flip(0)])
    today = gae_packed_lambdas(rewards, values, mask, cu, rows, gamma)
    traced = gae_packed_lambdas(rewards, values, mask, cu, rows, gamma, ratios=ones)
    assert torch.equal(traced, today)
    adv, ret = gae_packed(rewards, values, mask, cu, lams, gamma, ratios=ones)
    ref_adv, ref_ret = gae_packed(rewards, values, mask, cu, lams, gamma)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_ratios_on_the_shortcut_rows_within_rounding(dtype):
    # Two paths today's GAE takes and traces cannot: rows with gamma * lambda = 1 everywhere
    # (VAPO's critic) are float64 suffix sums, one-run padded rows the row scan. With traces
    # both take the segmented scan in the inputs' dtype, so they agree to its rounding: float32
    # sums of ~200 terms of size ~1 (1e-5), float64 (1e-12).
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    rewards, values, mask, cu, lams, _ = packed_batch(4, gaps=True, dtype=dtype)
    ones = torch.ones(rewards.numel(), dtype=dtype)
    cfg = algo_preset("vapo")  # lambda_critic = gamma = 1, length-adaptive lambda_policy
    got = decoupled_gae_packed(cfg, rewards, values, mask, cu, ratios=ones)
    want = decoupled_gae_packed(cfg, rewards, values, mask, cu)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)
    rows = [x[:256].view(4, 64) for x in (rewards, values, mask)]
    rows[2][:, :5] = rows[2][:, -7:] = False  # prompt, response, padding: one run per row
    rows[0] = rows[0] * rows[2]
    got = decoupled_gae_padded(cfg, *rows, ratios=torch.ones(4, 64, dtype=dtype))
    want = decoupled_gae_padded(cfg, *rows)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


# ----- (2) random ratios against the sum formula -----


@pytest.mark.parametrize("bars", [(1.0, 1.0), (1.5, 0.8)])
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("scan_chunk,block", [(64, 1 << 20), (3, 100)])
def test_traces_match_the_sum_formula(monkeypatch, bars, gaps, scan_chunk, block):
    # Small chunks force several levels of the chunk-start recursion; small blocks cut the
    # step into blocks of whole sequences (the ratios must be cut with them).
    monkeypatch.setattr(gae_module, "SCAN_CHUNK", scan_chunk)
    monkeypatch.setattr(gae_module, "GAE_BLOCK_TOKENS", block)
    rho_bar, c_bar = bars
    rewards, values, mask, cu, lams, ratios = packed_batch(5, gaps)
    for gamma in (1.0, 0.95):
        adv, ret = gae_packed(
            rewards, values, mask, cu, lams, gamma, ratios=ratios, rho_bar=rho_bar, c_bar=c_bar
        )
        ref = sum_formula(rewards, values, mask, cu, lams, gamma, ratios, rho_bar, c_bar)
        torch.testing.assert_close(adv, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ret, (ref + values) * mask, atol=1e-10, rtol=1e-10)


def test_both_lambdas_take_the_traces():
    # VAPO's decoupled GAE: advantages with lambda_policy(l), returns with lambda_critic = 1,
    # both with the same traces, packed and padded.
    rewards, values, mask, cu, _, ratios = packed_batch(6, gaps=False, lengths=[40, 7, 64, 1])
    cfg = algo_preset("vapo")
    adv, ret, lam_policy = decoupled_gae_packed(
        cfg, rewards, values, mask, cu, ratios=ratios, rho_bar=1.5, c_bar=0.8
    )
    traces = (ratios, 1.5, 0.8)
    ref_adv = sum_formula(rewards, values, mask, cu, lam_policy, cfg.gamma, *traces)
    ref_ret = sum_formula(rewards, values, mask, cu, torch.ones(4), cfg.gamma, *traces) + values
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=1e-10)
    # Padded: the same sequences as rows of 64 (rows 1 and 3 end in padding).
    rows = torch.zeros(3, 4, 64, dtype=torch.float64)
    row_mask = torch.zeros(4, 64, dtype=torch.bool)
    for s in range(4):
        lo, hi = int(cu[s]), int(cu[s + 1])
        for field, x in enumerate((rewards, values, ratios)):
            rows[field, s, : hi - lo] = x[lo:hi]
        row_mask[s, : hi - lo] = True
    padded = decoupled_gae_padded(
        cfg, rows[0], rows[1], row_mask, ratios=rows[2], rho_bar=1.5, c_bar=0.8
    )
    torch.testing.assert_close(padded[0][row_mask], adv, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(padded[1][row_mask], ret, atol=1e-10, rtol=1e-10)


def test_the_reference_tells_rho_from_c_and_traces_from_none():
    # The data of the tests above can fail a wrong implementation: with rho and c swapped,
    # or with the traces ignored, the sum formula moves far beyond the tolerance.
    rewards, values, mask, cu, lams, ratios = packed_batch(5, gaps=True)
    adv, _ = gae_packed(
        rewards, values, mask, cu, lams, 0.95, ratios=ratios, rho_bar=1.5, c_bar=0.8
    )
    swapped = sum_formula(rewards, values, mask, cu, lams, 0.95, ratios, 0.8, 1.5)
    ignored = sum_formula(rewards, values, mask, cu, lams, 0.95, torch.ones_like(ratios), 1, 1)
    assert (adv - swapped).abs().max() > 1e-2
    assert (adv - ignored).abs().max() > 1e-2


# ----- (3) truncation -----


def test_ratios_above_the_bars_are_clipped():
    rewards, values, mask, cu, lams, ratios = packed_batch(7, gaps=True)
    assert (ratios > 1.5).any() and ((ratios > 0.8) & (ratios < 1.5)).any()
    for rho_bar, c_bar in ((1.0, 1.0), (1.5, 0.8)):
        bars = {"rho_bar": rho_bar, "c_bar": c_bar}
        got = gae_packed(rewards, values, mask, cu, lams, 0.9, ratios=ratios, **bars)
        clipped = ratios.clamp(max=rho_bar)
        higher = torch.where(ratios > rho_bar, ratios * 10, ratios)
        for same in (clipped, higher):
            want = gae_packed(rewards, values, mask, cu, lams, 0.9, ratios=same, **bars)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_lambda_zero_is_one_step_importance_weighted_td():
    # lambda = 0: A_t = rho_t delta_t, whatever c.
    rewards, values, mask, cu, _, ratios = packed_batch(8, gaps=False)
    adv, _ = gae_packed(rewards, values, mask, cu, 0.0, 1.0, ratios=ratios, rho_bar=1.5, c_bar=0.5)
    ends = cu[1:][cu.diff() > 0] - 1
    next_value = torch.nn.functional.pad(values[1:], (0, 1))
    next_value[ends] = 0.0
    torch.testing.assert_close(adv, ratios.clamp(max=1.5) * (rewards + next_value - values))


# ----- (4) context parallel -----


def run_cp_ranks(monkeypatch, cp, call):
    """[call(rank) for each rank] of a simulated CP group of ``cp`` ranks in this process: a
    first pass records each rank's all-gathered summary (it depends on the rank's own tokens
    only), a second hands every rank all of them, as the real all-gather would."""
    summaries = [None] * cp
    state = SimpleNamespace(rank=0, replay=False)

    def all_gather(tensor, group):
        if not state.replay:
            summaries[state.rank] = tensor.clone()
            return [tensor] * cp
        assert torch.equal(tensor, summaries[state.rank])
        return summaries

    fake = SimpleNamespace(get_world_size=lambda group: cp, get_rank=lambda group: state.rank)
    monkeypatch.setattr(cp_gae, "dist", fake)
    monkeypatch.setattr(cp_gae, "collectives", SimpleNamespace(all_gather=all_gather))
    for state.replay in (False, True):
        results = []
        for state.rank in range(cp):
            results.append(call(state.rank))
    return results


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("traced", [False, True])
def test_cp_shards_equal_the_packed_scan(monkeypatch, cp, traced):
    # Lengths are multiples of 2 * CP; masks with gaps leave whole chunks without a response
    # token; lambda 0 and 1 among random ones.
    lengths = [48, 8, 0, 40, 48, 24, 16]
    rewards, values, mask, cu, lams, ratios = packed_batch(9, gaps=True, lengths=lengths)
    mask[48:56] = False  # the second sequence: no response token at all
    mask[96:120] = False  # the fourth: its first chunks empty
    rewards = rewards * mask
    traces = {"ratios": ratios if traced else None, "rho_bar": 1.5, "c_bar": 0.8}
    group = object()
    for gamma in (1.0, 0.95):
        ref_adv, ref_ret = gae_packed(rewards, values, mask, cu, lams, gamma, **traces)

        def shard(rank, gamma=gamma):
            local = [split_packed_for_cp(x, cu, cp, rank) for x in (rewards, values, mask, ratios)]
            return cp_gae.gae_context_parallel_packed(
                *local[:3], cu, lams, gamma, group,
                ratios=local[3] if traced else None, rho_bar=1.5, c_bar=0.8,
            )  # fmt: skip

        for rank, (adv, ret) in enumerate(run_cp_ranks(monkeypatch, cp, shard)):
            want_adv, want_ret = (split_packed_for_cp(x, cu, cp, rank) for x in (ref_adv, ref_ret))
            torch.testing.assert_close(adv, want_adv, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(ret, want_ret, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_padded_shards_with_traces_equal_the_padded_gae(monkeypatch, cp):
    gen = torch.Generator().manual_seed(10)
    batch, length = 4, 48
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) > 0.3
    mask[1] = False
    mask[2, :30] = False
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64) * mask
    ratios = torch.exp(0.6 * torch.randn(batch, length, generator=gen, dtype=torch.float64))
    lam = torch.tensor([0.9, 0.5, 1.0, 0.0], dtype=torch.float64)
    ref = gae_padded(rewards, values, mask, lam, 0.97, ratios=ratios, rho_bar=1.2, c_bar=0.9)

    def shard(rank):
        local = [split_for_cp(x, cp, rank) for x in (rewards, values, mask, ratios)]
        return cp_gae.gae_context_parallel(
            *local[:3], lam, 0.97, object(), ratios=local[3], rho_bar=1.2, c_bar=0.9
        )

    for rank, got in enumerate(run_cp_ranks(monkeypatch, cp, shard)):
        for g, want in zip(got, ref, strict=True):
            torch.testing.assert_close(g, split_for_cp(want, cp, rank), atol=1e-10, rtol=1e-10)


def test_cp_traces_make_no_tensor_without_a_device(monkeypatch):
    rewards, values, mask, cu, lams, ratios = packed_batch(11, gaps=True, lengths=[16, 8])
    rewards = rewards * mask

    def shard(rank):
        local = [split_packed_for_cp(x, cu, 2, rank) for x in (rewards, values, mask, ratios)]
        with DevicelessFactoryCalls() as recorder:
            cp_gae.gae_context_parallel_packed(*local[:3], cu, lams, 1.0, object(), ratios=local[3])
            gae_packed(rewards, values, mask, cu, lams, 1.0, ratios=ratios)
        return recorder.calls

    assert run_cp_ranks(monkeypatch, 2, shard) == [[], []]


# ----- (5) bad inputs -----


def test_bad_traces_are_refused():
    rewards, values, mask, cu, lams, ratios = packed_batch(12, gaps=False, lengths=[4, 4])
    args = (rewards, values, mask, cu, lams, 1.0)
    for bad, match in (
        (ratios[:-1], r"shape \(8,\).*\(7,\)"),
        (torch.ones(8, dtype=torch.long), "float tensor"),
        (torch.tensor([1.0, float("nan"), 1, 1, 1, 1, 1, 1]), r"1 importance ratio.*nan at \[1\]"),
        (torch.tensor([1.0, 1, float("inf"), 1, 1, 1, 1, 1]), r"inf at \[2\]"),
        (torch.tensor([1.0, 1, 1, -0.5, 1, 1, 1, 1]), r"-0.5 at \[3\]"),
    ):
        with pytest.raises(ValueError, match=match):
            gae_packed(*args, ratios=bad)
    for rho_bar, c_bar in ((0.0, 0.0), (1.0, 0.0), (1.0, -1.0), (0.5, 0.8), (2.0, 1.5)):
        with pytest.raises(ValueError, match=f"rho_bar={rho_bar}, c_bar={c_bar}"):
            gae_packed(*args, ratios=ratios, rho_bar=rho_bar, c_bar=c_bar)
    with pytest.raises(ValueError, match="rho_bar=inf"):
        gae_packed(*args, ratios=ratios, rho_bar=float("inf"))
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        gae_padded(rewards.view(2, 4), values.view(2, 4), mask.view(2, 4), 0.9, ratios=ratios)
    with pytest.raises(ValueError, match="negative or not finite"):
        cp_gae.gae_context_parallel_packed(
            rewards, values, mask, cu, lams, 1.0, None, ratios=-ratios.abs() - 1
        )
