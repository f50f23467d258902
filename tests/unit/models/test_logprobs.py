import pytest
import torch

from vapo_megatron.models.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def reference(logits, labels, vocab_size, temperature):
    logp = torch.log_softmax(logits[..., :vocab_size] / temperature, -1)
    return logp.gather(-1, labels[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_log_softmax_and_gradients(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 40, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 33, (2, 5), generator=gen)
    logp, ent = vocab_parallel_logprobs(
        logits, labels, tp_group=None, vocab_size=33, temperature=temperature
    )
    ref_logp, ref_ent = reference(logits, labels, 33, temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    weights = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((logp * weights[0] + ent * weights[1]).sum(), logits)[0]
    want = torch.autograd.grad((ref_logp * weights[0] + ref_ent * weights[1]).sum(), logits)[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.all(got[..., 33:] == 0)  # padded vocabulary gets no gradient
    # int32 labels (packing's host dtype) give the same log-probs and gradients
    logp32, ent32 = vocab_parallel_logprobs(
        logits, labels.int(), tp_group=None, vocab_size=33, temperature=temperature
    )
    assert torch.equal(logp32, logp) and torch.equal(ent32, ent)
    got32 = torch.autograd.grad((logp32 * weights[0] + ent32 * weights[1]).sum(), logits)[0]
    assert torch.equal(got32, got)


def test_gradcheck_and_fp32_input():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 5, 9])
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, labels, tp_group=None, vocab_size=10, temperature=0.8),
        (logits,),
    )
    logp, ent = vocab_parallel_logprobs(logits.float(), labels, tp_group=None, vocab_size=10)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(
            torch.zeros(2, 4),
            torch.zeros(2, dtype=torch.long),
            tp_group=None,
            vocab_size=4,
            temperature=0,
        )
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_logprobs(
            torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), tp_group=None, vocab_size=4
        )
