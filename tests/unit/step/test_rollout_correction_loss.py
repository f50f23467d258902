"""The rollout correction in the policy loss: UpdateData's weight fields, packed, weigh the
PPO term of ``step/losses.policy_loss_fn`` exactly as a hand-written loop does."""

import pytest
import torch

from vapo_megatron.algorithms.config import AlgoConfig
from vapo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig
from vapo_megatron.data.packing import pack
from vapo_megatron.models.logprobs import VocabSlice
from vapo_megatron.parallel.reductions import LossNormalisers
from vapo_megatron.step.batching import Ragged, build_samples
from vapo_megatron.step.losses import policy_loss_fn
from vapo_megatron.step.outputs import TokenFields
from vapo_megatron.step.updates import CORRECTION_FIELDS, POLICY_FIELDS, UpdateData

pytestmark = pytest.mark.unit

VOCAB = 11


def _data(correction):
    torch.manual_seed(0)
    prompts = Ragged(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32), torch.tensor([0, 2, 5]))
    responses = Ragged(
        torch.tensor([6, 7, 8, 9, 10, 3, 4], dtype=torch.int32), torch.tensor([0, 4, 7])
    )
    old = -torch.rand(7) - 0.5
    arrays = {"old_logprobs": old, "advantages": torch.randn(7)}
    rollout = old + torch.tensor([0.0, 1.2, -0.9, 0.1, -0.2, 0.5, 0.0])  # rho = e^-(...)
    data = UpdateData(
        prompts=prompts, responses=responses, fields=TokenFields([0, 4], arrays),
        positive=[False, False], trainable_policy=[True, True], path=None,
        rollout_logprobs=rollout, correction=correction,
    )  # fmt: skip
    return data, old, rollout, arrays["advantages"]


@pytest.mark.parametrize("truncate", ["off", "token", "sequence"])
def test_weighted_policy_loss_equals_hand_loop(truncate):
    correction = RolloutCorrectionConfig(truncate=truncate, truncate_at=1.5, mask="token")
    data, old, rollout, adv = _data(correction)
    assert data.policy_field_names == POLICY_FIELDS + CORRECTION_FIELDS
    samples = build_samples(
        data.prompts, data.responses, [0, 1], data.responses.offsets, data.policy_fields,
        flat_index=False,
    )  # fmt: skip
    mb = pack(samples)
    logits = torch.randn(1, mb.tokens.shape[1], VOCAB, dtype=torch.float64)
    algo = AlgoConfig(positive_nll_coef=0.0, eps_low=0.2, eps_high=0.28)
    norm = LossNormalisers(
        torch.tensor(7.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64),
        torch.tensor(0.0, dtype=torch.float64),
    )  # fmt: skip
    loss, metrics = policy_loss_fn(algo, norm, VocabSlice(None, VOCAB))(logits, mb)

    # The hand loop: new log-probs at the label-aligned positions, then w * PPO per token.
    logp = torch.log_softmax(logits[0], -1).gather(-1, mb.labels[0, :, None])[:, 0]
    new = logp[mb.response_mask[0]]
    rho = (old - rollout).exp()
    keep = (rho >= 0.5) & (rho <= 2.0)
    if truncate == "token":
        w = rho.clamp(max=1.5)
    elif truncate == "sequence":
        w = torch.cat(
            [rho[:4].prod().clamp(max=1.5).expand(4), rho[4:].prod().clamp(max=1.5).expand(3)]
        )
    else:
        w = torch.ones(7)
    w = w * keep
    total = 0.0
    for t in range(7):
        r = float((new[t] - old[t]).exp())
        a = float(adv[t])
        total += float(w[t]) * max(-a * r, -a * min(max(r, 0.8), 1.28))
    assert loss.item() == pytest.approx(total / 7, rel=1e-5)
    assert metrics["rollout_masked_frac"].item() == pytest.approx(float((~keep).sum()) / 7)
    assert metrics["rollout_is_weight"].item() == pytest.approx(float(w.sum()) / 7, rel=1e-5)
    assert int((~keep).sum()) == 2  # the case masks two tokens


def test_correction_off_adds_no_fields():
    data, *_ = _data(RolloutCorrectionConfig())
    assert data.policy_field_names == POLICY_FIELDS
    assert set(data.policy_fields(0, slice(0, 4))) == set(POLICY_FIELDS)


def test_correction_without_rollout_logprobs_is_refused():
    data, *_ = _data(RolloutCorrectionConfig(truncate="token"))
    data.rollout_logprobs = None
    with pytest.raises(ValueError, match="rollout log-probs"):
        data.policy_fields(0, slice(0, 4))
