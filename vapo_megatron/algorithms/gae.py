"""Generalised advantage estimation without a Python loop over time steps.

Conventions (DESIGN.md, "Positions"): ``values[t]`` is V(s_t), the value of the state before
response token t; ``rewards[t]`` is the reward received for token t (VAPO: the verifier's score
at the last response token, 0 elsewhere); the value after the last response token is 0
(terminal). Only tokens where ``response_mask`` is true take part: the recurrence runs over the
response tokens of each sequence in order, and masked tokens are skipped (their advantage and
return are 0). A nonzero reward on a masked token is an error (it would be dropped silently):
the usual cause is a reward placed one position after the last response token.

    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last response token = 0)
    A_t     = delta_t + gamma * lambda * A_{t+1}   (A after the last response token = 0)

Decoupled GAE (VAPO) is two calls: advantages with lambda_policy, and critic targets
``returns = A(lambda_critic) + V`` from a second call with lambda_critic.

Truncated importance traces (V-trace with lambda; Espeholt et al. 2018, eq. 1 with
c_i = lambda * min(c_bar, r_i)), for rollouts sampled by an older policy mu (the engine's
per-token log-probs) and scored by the current one, pi_old: with ``ratios`` r_t =
pi_old(a_t) / mu(a_t) on the response tokens (indices as above, masked tokens skipped),

    rho_t = min(rho_bar, r_t),   c_t = min(c_bar, r_t)
    A_t   = sum_{k>=t} gamma^(k-t) (prod_{i=t}^{k-1} lambda c_i) rho_k delta_k
          = rho_t delta_t + gamma * lambda * c_t * A_{t+1}
    returns_t = V_t + A_t

returns_t is the V-trace target v_t (the lambda-return corrected towards pi_old, with the
same traces), so both of VAPO's lambdas take the traces through this one function; the
policy's advantage is the same sum with lambda_policy. ratios = None is the GAE above (the
same code, the same bits); r_t = 1 everywhere with rho_bar = c_bar = 1 is the same
function. The scan is the same segmented reverse scan with the per-token coefficient
gamma * lambda * c_t and input rho_t * delta_t. 0 < c_bar <= rho_bar: rho_bar sets the
fixed point (the value of the policy proportional to min(rho_bar mu, pi_old)), c_bar only
how fast the traces cut; V-trace's contraction argument assumes c_bar <= rho_bar, and
c_bar <= 1 keeps every product of coefficients in [0, 1] (a product of c_t > 1 over a
20k-token response would overflow), so both are required.

The scan: with c = gamma * lambda constant within a sequence, A_t = sum_{k>=t} c^(k-t) delta_k,
a reverse discounted cumulative sum. It is computed in chunks of ``CHUNK`` tokens: inside a
chunk, one batched matrix product with the [C, C] matrix of powers c^(k-t); across chunks, the
same problem again on the chunks' first elements with coefficient c^C (recursively). Every
power is of a number in [0, 1] with a non-negative exponent, so nothing overflows at T = 32k
and c = 0 or 1 is exact.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from vapo_megatron.algorithms.masks import all_true

CHUNK = 16
SCAN_CHUNK = 64  # tokens per chunk of the packed (segmented) scan
SCAN_TILE = 16  # chunks per tile of its position-major layout
GAE_BLOCK_TOKENS = 1 << 20  # tokens per block of whole sequences in packed GAE (memory bound)


def length_adaptive_lambda(num_response_tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's lambda_policy = 1 - 1 / (alpha * l), clamped to [0, 1].

    num_response_tokens: [B] integer or float lengths l. Returns [B] float64.
    l <= 1/alpha gives 0 (e.g. l <= 20 at alpha = 0.05); lengths of 0 give 0.
    """
    if alpha <= 0:
        raise ValueError(f"length-adaptive GAE needs alpha > 0, got alpha={alpha}")
    length = num_response_tokens.to(torch.float64)
    lam = 1.0 - 1.0 / (alpha * length.clamp(min=1e-12))
    return lam.clamp(0.0, 1.0)


def reverse_discounted_cumsum(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """y_t = x_t + coef * y_{t+1} along the last dim, with y past the end = 0.

    x: [B, T] float; coef: [B] in [0, 1] (one coefficient per row). Returns [B, T].
    """
    batch, length = x.shape
    coef = coef.to(x.dtype).reshape(batch)
    if length == 0:
        return x.clone()
    chunk = min(CHUNK, length)
    num_chunks = -(-length // chunk)
    padded = num_chunks * chunk
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
    # powers[b, t, k] = coef_b^(k - t) for k >= t, else 0: y_local = powers @ x_chunk.
    offset = torch.arange(chunk, device=x.device)
    exponent = (offset[None, :] - offset[:, None]).to(x.dtype)  # [C, C], k - t
    upper = exponent >= 0
    powers = torch.pow(coef[:, None, None], exponent.clamp(min=0)[None]) * upper[None]
    x_chunks = x.view(batch, num_chunks, chunk)
    if num_chunks == 1:
        return torch.matmul(x_chunks, powers.transpose(1, 2)).view(batch, padded)[:, :length]
    # Value at each chunk's first token: y0_i = (chunk i's own sum) + coef^C * y0_{i+1}.
    own_first = torch.matmul(x_chunks, powers[:, 0, :, None]).squeeze(-1)  # [B, n]
    first = reverse_discounted_cumsum(own_first, coef**chunk)
    next_first = torch.nn.functional.pad(first[:, 1:], (0, 1))  # [B, n]
    tail = torch.pow(coef[:, None], (chunk - offset).to(x.dtype)[None])  # [B, C]: coef^(C - t)
    carried = next_first[:, :, None] * tail[:, None, :]  # [B, n, C]
    local = carried.baddbmm_(x_chunks, powers.transpose(1, 2))  # in place: no new buffer
    return local.reshape(batch, padded)[:, :length]


class _Traces(NamedTuple):
    """Importance ratios [N] (one per token of the arrays they travel with) and their bars."""

    ratios: torch.Tensor
    rho_bar: float
    c_bar: float


def importance_traces(
    ratios: torch.Tensor, rho_bar: float, c_bar: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho, c) = (min(rho_bar, r), min(c_bar, r)) of ratios r (any shape), in ``dtype``."""
    ratios = ratios.to(dtype)
    return ratios.clamp(max=rho_bar), ratios.clamp(max=c_bar)


def check_importance_ratios(
    ratios: torch.Tensor | None, shape: torch.Size, rho_bar: float, c_bar: float
) -> None:
    """Raise ValueError unless 0 < c_bar <= min(rho_bar, 1) (finite; see the module docstring)
    and ratios is None or a float tensor of ``shape`` with finite, non-negative entries
    (everywhere: masked tokens' ratios are dropped, but a NaN there is still a caller's bug)."""
    if not (0 < c_bar <= 1 and c_bar <= rho_bar and math.isfinite(rho_bar)):
        raise ValueError(
            f"importance traces need 0 < c_bar <= rho_bar (finite) and c_bar <= 1, got "
            f"rho_bar={rho_bar}, c_bar={c_bar} (V-trace's usual choice: rho_bar = c_bar = 1)"
        )
    if ratios is None:
        return
    if not ratios.is_floating_point() or ratios.shape != shape:
        raise ValueError(
            f"ratios must be a float tensor of the rewards' shape {tuple(shape)} (one "
            f"pi_old / mu per token), got {ratios.dtype} {tuple(ratios.shape)}"
        )
    bad = ~torch.isfinite(ratios) | (ratios < 0)
    if bad.any():
        first = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{int(bad.sum())} importance ratio(s) are negative or not finite (first "
            f"{ratios[tuple(first)].item()} at {first}); compute them as "
            f"exp(logp_old - logp_behaviour) from finite log-probs"
        )


def _is_one_run_per_row(mask: torch.Tensor) -> bool:
    """True when every row of mask [B, T] holds its true entries as one contiguous run (or none).

    A row with k runs has 2k - [starts on] - [ends on] value changes; counted on a uint8 view
    with an int32 sum (a bool sum would first copy the mask to int64).
    """
    bits = mask.view(torch.uint8)
    changes = (bits[:, 1:] ^ bits[:, :-1]).sum(1, dtype=torch.int32)
    return bool((changes + bits[:, 0] + bits[:, -1] <= 2).all())


def _gae_rows(rewards, values, mask, lam, gamma):
    """GAE for rows [B, T] whose response tokens form one contiguous run per row (or none).

    Deltas off the run are zeroed, so one scan over the whole row with the row's constant
    coefficient gives the right advantages on the run; everything off the run is zeroed.
    Each line below is one fused pass over [B, T] (this is memory-bound).
    """
    batch = rewards.shape[0]
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    keep = mask.to(dtype)
    # delta_t = r_t + gamma * V_{t+1} - V_t; V_{t+1} counts only while t+1 is on the run, so the
    # value after each row's last response token is 0 (terminal).
    deltas = torch.sub(rewards, values)
    deltas[:, :-1].addcmul_(values[:, 1:], keep[:, 1:], value=gamma)
    deltas.mul_(keep)
    lam = torch.as_tensor(lam, dtype=dtype, device=rewards.device).expand(batch)
    advantages = reverse_discounted_cumsum(deltas, gamma * lam).mul_(keep)
    returns = torch.addcmul(advantages, values, keep)
    return advantages, returns


def segmented_reverse_cumsum(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """y_t = x_t + coef_t * y_{t+1} along the last dim, with y past the end = 0.

    x, coef: [K, N] float (K independent scans over the same N tokens); coef_t = 0 cuts the
    scan after t, so packed sequences laid end to end scan with no padding at all. Returns a
    new [K, N] tensor.

    Chunks of C = ``SCAN_CHUNK`` tokens; tiles of B = ``SCAN_TILE`` chunks are stored position-
    major ([K, tiles, C, B]), so the sequential loop over a chunk's C positions updates every
    chunk at once through runs of B contiguous floats, and the re-layout is a cache-friendly
    per-tile transpose (a whole-buffer transpose costs several memcpys). Each chunk's start
    then takes the chunks to its right through the same recurrence on N / C values
    (recursively), and one fused pass adds that carry everywhere.
    """
    num_rows, length = x.shape
    chunk = min(SCAN_CHUNK, max(length, 1))
    num_chunks = -(-length // chunk)
    tile = min(SCAN_TILE, max(num_chunks, 1))
    num_tiles = -(-num_chunks // tile)
    padded = num_tiles * tile * chunk
    shape = (num_rows, num_tiles, tile, chunk)

    def position_major(t):  # [K, N] -> [K, tiles, C, B], zero-padded (coef 0 cuts the pad off)
        out = torch.empty(shape[:2] + (chunk, tile), dtype=x.dtype, device=x.device)
        full = length // (tile * chunk)  # whole tiles: one transposing copy, no padded copy
        cut = full * tile * chunk
        out[:, :full].copy_(t[:, :cut].view(num_rows, full, tile, chunk).transpose(2, 3))
        if full < num_tiles:
            rest = torch.zeros(num_rows, tile * chunk, dtype=x.dtype, device=x.device)
            rest[:, : length - cut] = t[:, cut:]
            out[:, full:].copy_(rest.view(num_rows, 1, tile, chunk).transpose(2, 3))
        return out

    ys, prods = position_major(x), position_major(coef.to(x.dtype))
    for j in range(chunk - 2, -1, -1):
        ys[:, :, j].addcmul_(prods[:, :, j], ys[:, :, j + 1])  # prods[j] is still coef_j here
        prods[:, :, j].mul_(prods[:, :, j + 1])  # now: coef_j * ... * coef_(chunk end)
    if num_chunks > 1:
        # Full value at each chunk's start: Y_i = ys[0, i] + prods[0, i] * Y_(i+1).
        first_y = ys[:, :, 0].reshape(num_rows, -1)
        starts = segmented_reverse_cumsum(first_y, prods[:, :, 0].reshape(num_rows, -1))
        after = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # Y_(i+1), 0 past the end
        ys.addcmul_(prods, after.view(num_rows, num_tiles, 1, tile))
    return ys.transpose(2, 3).reshape(num_rows, padded)[:, :length]


def _gae_flat(rewards, values, cu_seqlens, lams, gamma, traces):
    """GAE over packed sequences whose every token is a response token, in blocks of whole
    sequences of about ``GAE_BLOCK_TOKENS`` tokens: sequences are independent, and the scan's
    temporaries (~10 floats per token) then stay a block's size, not the step's.

    rewards, values: [N]; cu_seqlens: [S + 1] on their device; lams: [K, S]; traces: None or
    ratios [N] with their bars. Returns advantages [K, N].
    """
    num_tokens = rewards.numel()
    if num_tokens <= GAE_BLOCK_TOKENS:
        return _gae_block(rewards, values, cu_seqlens, lams, gamma, traces)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    out = torch.empty(lams.shape[0], num_tokens, dtype=dtype, device=rewards.device)
    targets = torch.arange(
        GAE_BLOCK_TOKENS, num_tokens, GAE_BLOCK_TOKENS, device=cu_seqlens.device
    )  # a block ends at the first sequence boundary at or after each multiple
    cuts = torch.searchsorted(cu_seqlens, targets).unique().tolist()
    seq_bounds = [0, *(c for c in cuts if 0 < c < lams.shape[1]), lams.shape[1]]
    for first, last in zip(seq_bounds[:-1], seq_bounds[1:], strict=True):
        lo, hi = int(cu_seqlens[first]), int(cu_seqlens[last])
        block_traces = None if traces is None else traces._replace(ratios=traces.ratios[lo:hi])
        _gae_block(
            rewards[lo:hi], values[lo:hi], cu_seqlens[first : last + 1] - lo,
            lams[:, first:last], gamma, block_traces, out=out[:, lo:hi],
        )  # fmt: skip
    return out


def _gae_block(rewards, values, cu_seqlens, lams, gamma, traces, out=None):
    """GAE over packed sequences whose every token is a response token.

    rewards, values: [N]; cu_seqlens: [S + 1] on their device; lams: [K, S] float (K lambdas
    per sequence, e.g. policy and critic); traces: None or ratios [N] with their bars. Returns
    advantages [K, N] (float32 unless float64 inputs), written into ``out`` when given. The
    scan coefficient is gamma * lambda (times c_t with traces) inside a sequence and 0 at its
    last token; with traces the scan's input is rho_t * delta_t.
    """
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    lengths = cu_seqlens.diff()
    ends = cu_seqlens[1:][lengths > 0] - 1  # each nonempty sequence's last token
    # delta_t = r_t + gamma * V_(t+1) - V_t, with V after a sequence's last token = 0.
    deltas = torch.sub(rewards, values)
    deltas[:-1].add_(values[1:], alpha=gamma)
    deltas[ends] = rewards[ends] - values[ends]
    if out is None:
        out = torch.empty(lams.shape[0], deltas.numel(), dtype=dtype, device=deltas.device)
    if traces is not None:  # c_t varies along a sequence: every row scans
        rho, c = importance_traces(traces.ratios, traces.rho_bar, traces.c_bar, dtype)
        coef = _per_token((gamma * lams).to(dtype), cu_seqlens).mul_(c)  # [K, N]
        coef[:, ends] = 0
        out.copy_(segmented_reverse_cumsum(deltas.mul_(rho).expand(lams.shape[0], -1), coef))
        return out
    # Rows with gamma * lambda = 1 on every sequence (VAPO's critic: lambda_critic = gamma = 1)
    # telescope to plain suffix sums of the deltas: one float64 cumsum, no scan.
    plain = ((gamma * lams) == 1).all(dim=1).tolist()  # [K]
    scanned = [k for k, p in enumerate(plain) if not p]
    if scanned:
        coef = _per_token((gamma * lams[scanned]).to(dtype), cu_seqlens)  # [K', N]
        coef[:, ends] = 0
        rows = segmented_reverse_cumsum(deltas.expand(len(scanned), -1), coef)
        for row, k in enumerate(scanned):
            out[k] = rows[row]
    if len(scanned) < len(plain):
        suffix = _suffix_sums(deltas, cu_seqlens)
        for k in (k for k, p in enumerate(plain) if p):
            out[k] = suffix
    return out


def _suffix_sums(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """y_t = sum of x over t and the rest of its sequence, [N] float64: the prefix sum at the
    sequence's last token minus the prefix sum before t, from one float64 cumsum (exact to
    float64 rounding, where the float32 scan it replaces rounds at every token)."""
    prefix = x.to(torch.float64).cumsum(0)
    lengths = cu_seqlens.diff()
    ends = torch.where(lengths > 0, cu_seqlens[1:] - 1, 0)  # empty sequences: no tokens anyway
    at_end = _per_token(prefix[ends][None], cu_seqlens)[0]
    return at_end.sub_(prefix).add_(x)


def _per_token(per_seq: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[K, N]: per_seq [K, S] repeated over each sequence's tokens. For long sequences one
    slice fill per sequence beats ``repeat_interleave`` (3x at the 32B step's ~5k-token mean,
    whose index gather dominates); for short ones the per-sequence Python loop would not."""
    num_seqs, num_tokens = per_seq.shape[1], int(cu_seqlens[-1])
    if num_tokens < 64 * num_seqs:
        return torch.repeat_interleave(per_seq, cu_seqlens.diff(), dim=1, output_size=num_tokens)
    out = torch.empty(per_seq.shape[0], num_tokens, dtype=per_seq.dtype, device=per_seq.device)
    bounds = cu_seqlens.tolist()
    for s in range(num_seqs):
        out[:, bounds[s] : bounds[s + 1]] = per_seq[:, s : s + 1]
    return out


def gae_packed_lambdas(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lams: torch.Tensor,
    gamma: float = 1.0,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> torch.Tensor:
    """GAE advantages on packed sequences with K lambdas per sequence in one scan, no padding.

    rewards, values, response_mask: [N]; cu_seqlens: [S + 1] (any device); lams: [K, S] in
    [0, 1]. Masked tokens are skipped (compacted out, scanned, scattered back as 0).
    ratios: None, or [N] float pi_old / mu per token on the rewards' device: the truncated
    importance traces of the module docstring (bars rho_bar, c_bar) on every row.
    Returns advantages [K, N]; the returns of row k are ``packed_returns(advantages[k], ...)``.
    """
    _check_packed(rewards, values, response_mask, cu_seqlens)
    check_importance_ratios(ratios, rewards.shape, rho_bar, c_bar)
    traces = None if ratios is None else _Traces(ratios, rho_bar, c_bar)
    cu_seqlens = cu_seqlens.to(rewards.device)
    if lams.dim() != 2 or lams.shape[1] != cu_seqlens.numel() - 1:
        raise ValueError(
            f"lams must be [K, {cu_seqlens.numel() - 1}] (K lambdas per sequence), "
            f"got {tuple(lams.shape)}"
        )
    if ((lams < 0) | (lams > 1)).any():
        raise ValueError(f"lam must lie in [0, 1], got min {lams.min()} max {lams.max()}")
    mask = response_mask.bool()
    if all_true(mask):  # every token is a response token: nothing to check or compact
        return _gae_flat(rewards, values, cu_seqlens, lams, gamma, traces)
    check_rewards_on_response(rewards, response_mask, "packed token")
    # Drop the masked tokens: each sequence keeps its response tokens, in order.
    token_index = mask.nonzero().squeeze(1)
    kept = torch.nn.functional.pad(mask.cumsum(0), (1, 0))[cu_seqlens]  # [S + 1]
    if traces is not None:
        traces = traces._replace(ratios=ratios[token_index])
    compact = _gae_flat(rewards[token_index], values[token_index], kept, lams, gamma, traces)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    advantages = torch.zeros(lams.shape[0], rewards.numel(), dtype=dtype, device=rewards.device)
    advantages[:, token_index] = compact
    return advantages


def packed_returns(
    advantages: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Critic targets [N]: advantages + values on the mask, 0 off it (all [N])."""
    values = values.to(advantages.dtype)
    if all_true(response_mask):
        return advantages + values
    return torch.addcmul(advantages, values, response_mask.to(advantages.dtype))


def check_rewards_on_response(
    rewards: torch.Tensor, response_mask: torch.Tensor, where: str = "position"
) -> None:
    """Raise ValueError if a nonzero reward sits on a token outside the response.

    rewards, response_mask: one common shape ([B, T] or [N]); ``where`` names the position
    format in the message. GAE skips masked tokens, so such a reward would vanish without a
    trace; it is almost always an off-by-one in placing the verifier's score, which belongs
    at the last response token.
    """
    stray = (rewards != 0) & ~response_mask.bool()
    count = int(stray.sum())
    if count:
        first = stray.nonzero()[0].tolist()
        raise ValueError(
            f"{count} nonzero reward(s) on tokens outside response_mask (first at {where} "
            f"{first[0] if len(first) == 1 else tuple(first)}); GAE would drop them. The reward "
            f"belongs at the last response token (mask true), not one position after it."
        )


def _check_lambda(lam, num_rows: int):
    if isinstance(lam, torch.Tensor):
        if lam.shape != (num_rows,):
            raise ValueError(
                f"lam must be a float or one value per sequence [{num_rows}], got {tuple(lam.shape)}"
            )
        if ((lam < 0) | (lam > 1)).any():
            raise ValueError(f"lam must lie in [0, 1], got min {lam.min()} max {lam.max()}")
    elif not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")


def gae_padded(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float = 1.0,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on a padded batch.

    rewards, values, response_mask: [B, T] (the mask marks response tokens; prompt and
    padding are 0, and may sit anywhere; rewards and values must be finite everywhere, since
    masking multiplies by 0; rewards must be 0 off the mask, else ValueError).
    lam: [B] per-sequence lambda or a float. ratios: None, or [B, T] float pi_old / mu per
    token (truncated importance traces, see the module docstring; rows then take the packed
    scan, whose per-token coefficients the one-run row scan lacks).
    Returns (advantages [B, T], returns [B, T]) with returns = advantages + values on response
    tokens and both 0 elsewhere. Float32 unless the inputs are float64.
    """
    if rewards.shape != values.shape or rewards.shape != response_mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and response_mask must share one [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    check_rewards_on_response(rewards, response_mask, "(row, column)")
    batch, length = rewards.shape
    _check_lambda(lam, batch)
    check_importance_ratios(ratios, rewards.shape, rho_bar, c_bar)
    mask = response_mask.bool()
    if ratios is None and _is_one_run_per_row(mask):
        return _gae_rows(rewards, values, mask, lam, gamma)
    # Several runs per row (e.g. multi-turn masks), or traces: the rows as packed sequences.
    cu_seqlens = torch.arange(batch + 1, device=rewards.device) * length
    lams = _lambda_rows(lam, batch, rewards.device)
    flat_mask = mask.reshape(-1)
    flat_ratios = None if ratios is None else ratios.reshape(-1)
    adv = gae_packed_lambdas(
        rewards.reshape(-1), values.reshape(-1), flat_mask, cu_seqlens, lams, gamma,
        ratios=flat_ratios, rho_bar=rho_bar, c_bar=c_bar,
    )[0]  # fmt: skip
    ret = packed_returns(adv, values.reshape(-1), flat_mask)
    return adv.view(batch, length), ret.view(batch, length)


def _check_packed(rewards, values, response_mask, cu_seqlens):
    if rewards.dim() != 1 or rewards.shape != values.shape or rewards.shape != response_mask.shape:
        raise ValueError(
            f"packed rewards, values and response_mask must share one [N] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    if (
        int(cu_seqlens[0]) != 0
        or int(cu_seqlens[-1]) != rewards.numel()
        or (cu_seqlens.diff() < 0).any()
    ):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the token count {rewards.numel()}, got "
            f"{cu_seqlens.tolist()}"
        )


def _lambda_rows(lam, num_seqs: int, device) -> torch.Tensor:
    """lam (a float or [S]) as the [1, S] float64 tensor gae_packed_lambdas takes."""
    _check_lambda(lam, num_seqs)
    if isinstance(lam, torch.Tensor):
        return lam.to(device=device, dtype=torch.float64)[None]
    return torch.full((1, num_seqs), float(lam), dtype=torch.float64, device=device)


def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float = 1.0,
    *,
    ratios: torch.Tensor | None = None,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE on packed sequences.

    rewards, values, response_mask: [N] flat tokens of S sequences laid end to end;
    cu_seqlens: [S + 1] boundaries (0, ..., N), on any device; lam: [S] or a float. Rewards
    must be 0 off the mask (else ValueError). ratios: None or [N] (truncated importance
    traces, see :func:`gae_packed_lambdas`). Returns (advantages [N], returns [N]).
    """
    _check_packed(rewards, values, response_mask, cu_seqlens)
    lams = _lambda_rows(lam, cu_seqlens.numel() - 1, rewards.device)
    advantages = gae_packed_lambdas(
        rewards, values, response_mask, cu_seqlens, lams, gamma,
        ratios=ratios, rho_bar=rho_bar, c_bar=c_bar,
    )[0]  # fmt: skip
    return advantages, packed_returns(advantages, values, response_mask)
