"""Worker: vocabulary-parallel log-probs and entropy at TP = world size equal one process's."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vapo_megatron.models.logprobs import vocab_parallel_logprobs


def main() -> None:
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    vocab_size, padded = 61, 64  # padded to a multiple of TP; the last ids are padding
    logits = torch.randn(3, 9, padded, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab_size, (3, 9), generator=gen)
    labels[0, 0], labels[0, 1] = 0, vocab_size - 1  # first and last real ids
    weights = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64)
    for temperature in (1.0, 0.7):
        full = logits.clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(
            full, labels, tp_group=None, vocab_size=vocab_size, temperature=temperature
        )
        (ref_grad,) = torch.autograd.grad((logp * weights[0] + ent * weights[1]).sum(), full)

        width = padded // tp
        shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
        logp_tp, ent_tp = vocab_parallel_logprobs(
            shard, labels, tp_group=dist.group.WORLD, vocab_size=vocab_size,
            vocab_start=rank * width, temperature=temperature,
        )  # fmt: skip
        (grad,) = torch.autograd.grad((logp_tp * weights[0] + ent_tp * weights[1]).sum(), shard)
        torch.testing.assert_close(logp_tp, logp, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(ent_tp, ent, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(
            grad, ref_grad[..., rank * width : (rank + 1) * width], atol=1e-12, rtol=1e-12
        )
    print(f"rank {rank}: TP={tp} log-probs, entropy and gradients equal one process")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
