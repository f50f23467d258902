"""Worker: ContextParallelDotProductAttention at CP = 2 and 4 equals CP = 1, on gloo.

Usage: ``python attention_worker.py`` as 4 ranks (``tests/launcher.py``). Every rank builds
the same seeded data and computes the CP = 1 reference itself, then runs each CP layout
(CP = 4, or CP = 2 twice side by side) and compares merged outputs and gradients:

1. module level, dense [s, b, h, d] and packed THD with uneven sequences: outputs and the
   gradients of q, k, v;
2. model level, a tiny megatron-core GPTModel on the local spec with this attention: logits
   and the gradients of every parameter, for a right-padded dense batch and a packed batch
   (whose CP = 1 logits also equal each sequence run alone, so RoPE restarts per sequence).

Losses use the sum / global-count rule: each rank sums its tokens' loss and divides by the
token count of the whole batch; the sum of the ranks' parameter gradients is then the
full-batch gradient. Rank 0 prints ``max diff`` lines for the report.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from vapo_megatron.models.attention import ContextParallelDotProductAttention
from vapo_megatron.models.layer_spec import local_layer_spec
from vapo_megatron.parallel.context_parallel import (
    merge_from_cp,
    split_for_cp,
    split_packed_for_cp,
)
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

SEED = 1234
TOL = dict(atol=1e-5, rtol=1e-5)
HEADS, GROUPS, HEAD_DIM = 4, 2, 16
REAL_LENGTHS = [5, 11, 3, 8]  # packed sequences; padded to multiples of 8 = 2 * max CP
VOCAB = 128
max_diffs: dict[str, float] = {}


def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    max_diffs[name] = max(max_diffs.get(name, 0.0), diff)


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_params() -> PackedSeqParams:
    padded = [-(-n // 8) * 8 for n in REAL_LENGTHS]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu(REAL_LENGTHS),
        cu_seqlens_kv=cu(REAL_LENGTHS),
        cu_seqlens_q_padded=cu(padded),
        cu_seqlens_kv_padded=cu(padded),
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )


def gather(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    shards = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(shards, x.contiguous(), group=group)
    return shards


def merge_packed(shards: list[torch.Tensor], cu_padded: torch.Tensor) -> torch.Tensor:
    """Inverse of ``split_packed_for_cp`` along dim 0."""
    local = (cu_padded.diff() // len(shards)).tolist()
    per_rank = [s.split(local, dim=0) for s in shards]
    return torch.cat([merge_from_cp(list(seq), dim=0) for seq in zip(*per_rank, strict=True)])


# ----- module level -----


def attention(cp_group: dist.ProcessGroup | None) -> ContextParallelDotProductAttention:
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_dropout=0.0,
    )
    groups = ProcessGroupCollection()
    groups.tp, groups.cp = None, cp_group
    return ContextParallelDotProductAttention(
        config, 1, AttnMaskType.causal, "self", pg_collection=groups
    )


def module_data(packed: bool) -> list[torch.Tensor]:
    """q, k, v and an output cotangent: [s, b, h, d] (dense) or [t, h, d] (packed)."""
    gen = torch.Generator().manual_seed(SEED + packed)
    lead = (int(packed_params().cu_seqlens_q_padded[-1]),) if packed else (16, 3)
    return [torch.randn(*lead, h, HEAD_DIM, generator=gen) for h in (HEADS, GROUPS, GROUPS, HEADS)]


def module_run(cp_group, packed: bool, split=None, merge=None):
    """Output and q/k/v grads of (out * cotangent).sum(), merged to the full layout."""
    q, k, v, cotangent = module_data(packed)
    params = packed_params() if packed else None
    if split is not None:
        q, k, v, cotangent = (split(x) for x in (q, k, v, cotangent))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = attention(cp_group)(q, k, v, None, packed_seq_params=params)
    (out * cotangent.flatten(-2)).sum().backward()
    results = [out.detach(), q.grad, k.grad, v.grad]
    return results if merge is None else [merge(x) for x in results]


def check_module(cp: int, cp_group: dist.ProcessGroup, cp_rank: int) -> None:
    cu_padded = packed_params().cu_seqlens_q_padded
    for packed in (False, True):
        want = module_run(None, packed)
        if packed:
            split = lambda x: split_packed_for_cp(x, cu_padded, cp, cp_rank)  # noqa: E731
            merge = lambda x: merge_packed(gather(x, cp_group), cu_padded)  # noqa: E731
        else:
            split = lambda x: split_for_cp(x, cp, cp_rank, dim=0)  # noqa: E731
            merge = lambda x: merge_from_cp(gather(x, cp_group), dim=0)  # noqa: E731
        got = module_run(cp_group, packed, split, merge)
        layout = "thd" if packed else "bshd"
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            record(f"module {layout} {name}", g, w)
    print(f"rank {dist.get_rank()}: module CP={cp} bshd+thd outputs and q/k/v grads equal CP=1")


# ----- model level -----


def build_gpt(cp: int) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        context_parallel_size=cp,
    )
    return GPTModel(
        config,
        transformer_layer_spec=local_layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
        rotary_base=1_000_000,
    )


def dense_batch() -> dict[str, torch.Tensor]:
    """Two right-padded rows of 16 tokens (real lengths 16 and 11)."""
    gen = torch.Generator().manual_seed(SEED + 10)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
    mask = torch.ones(2, 16)
    mask[1, 10:] = 0  # row 1: 11 real tokens, 10 with a next-token label
    return dict(
        tokens=tokens[:, :-1],
        labels=tokens[:, 1:],
        mask=mask,
        position_ids=torch.arange(16).expand(2, 16),
    )


def packed_batch() -> dict[str, torch.Tensor]:
    """REAL_LENGTHS sequences packed into one row, each padded to a multiple of 8."""
    gen = torch.Generator().manual_seed(SEED + 11)
    params = packed_params()
    total = int(params.cu_seqlens_q_padded[-1])
    tokens, labels = torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.long)
    mask, position_ids = torch.zeros(total), torch.zeros(total, dtype=torch.long)
    for start, n in zip(params.cu_seqlens_q_padded[:-1].tolist(), REAL_LENGTHS, strict=True):
        seq = torch.randint(0, VOCAB, (n,), generator=gen)
        tokens[start : start + n] = seq
        labels[start : start + n - 1] = seq[1:]
        mask[start : start + n - 1] = 1
        position_ids[start : start + n] = torch.arange(n)
    return dict(tokens=tokens, labels=labels, mask=mask, position_ids=position_ids)


def model_step(model: GPTModel, batch: dict, params: PackedSeqParams | None, count: float):
    """Logits [b, s, V] and the summed masked cross-entropy / count, with backward."""
    model.zero_grad(set_to_none=True)
    logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=params)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    (loss * batch["mask"].flatten()).sum().div(count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def model_reference() -> tuple[dict, dict]:
    """CP = 1 logits and grads of both batches, and the initial weights (every rank)."""
    initialize_megatron_cpu(cp=1, seed=SEED)
    model = build_gpt(1)
    dense = dense_batch()
    ref = {"dense": model_step(model, dense, None, dense["mask"].sum().item())}
    packed = {k: v[None] for k, v in packed_batch().items()}
    ref["packed"] = model_step(model, packed, packed_params(), packed["mask"].sum().item())
    # Packing changes nothing: each sequence alone, as a dense row, gives the same logits.
    starts = packed_params().cu_seqlens_q_padded[:-1].tolist()
    for start, n in zip(starts, REAL_LENGTHS, strict=True):
        alone = model(packed["tokens"][:, start : start + n], None, None)
        record("model packed vs alone logits", ref["packed"][0][:, start : start + n], alone)
    return ref, {k: v.clone() for k, v in model.state_dict().items() if v is not None}


def check_model(cp: int, ref: dict, weights: dict) -> None:
    groups = initialize_megatron_cpu(cp=cp, seed=SEED)
    cp_rank = groups.rank(groups.cp)
    model = build_gpt(cp)
    state = model.state_dict()
    same_init = all(torch.equal(state[k], v) for k, v in weights.items())
    model.load_state_dict(weights, strict=False)  # _extra_state entries are None

    cu_padded = packed_params().cu_seqlens_q_padded
    runs = {
        "dense": (
            {k: split_for_cp(v, cp, cp_rank, dim=1) for k, v in dense_batch().items()},
            None,
            lambda x: merge_from_cp(gather(x, groups.cp), dim=1),
            dense_batch()["mask"].sum().item(),
        ),
        "packed": (
            {
                k: split_packed_for_cp(v, cu_padded, cp, cp_rank)[None]
                for k, v in packed_batch().items()
            },
            packed_params(),
            lambda x: merge_packed(gather(x[0], groups.cp), cu_padded)[None],
            packed_batch()["mask"].sum().item(),
        ),
    }
    for layout, (batch, params, merge, count) in runs.items():
        logits, grads = model_step(model, batch, params, count)
        want_logits, want_grads = ref[layout]
        record(f"model {layout} logits", merge(logits), want_logits)
        for name, grad in grads.items():
            dist.all_reduce(grad, group=groups.cp)
            record(f"model {layout} grads", grad, want_grads[name])
    print(
        f"rank {dist.get_rank()}: model CP={cp} dense+packed logits and grads equal CP=1 "
        f"(same seed gives same weights: {same_init})"
    )


def main() -> None:
    start = time.monotonic()
    ref, weights = model_reference()
    for cp in (2, 4):
        groups = initialize_megatron_cpu(cp=cp, seed=SEED)
        check_module(cp, groups.cp, groups.rank(groups.cp))
        check_model(cp, ref, weights)
    if dist.get_rank() == 0:
        for name, diff in max_diffs.items():
            print(f"max diff {name}: {diff:.3g}")
        print(f"checks took {time.monotonic() - start:.1f}s")
    destroy()


if __name__ == "__main__":
    main()
