"""Worker: Qwen3 and Qwen3-MoE through the production model path (provider + default layer spec
+ ModelEngine on the model's own groups, HF weights through the record) give transformers'
logits (policy) and values (critic trunk + score) at each (TP, PP, CP, EP) layout, padded and
packed.

Usage: python qwen3_parity_worker.py FAMILY "1x1x1x1,2x1x1x1,1x2x1x1x2,..."  (TP x PP x CP x
EP, then VPP where a fifth field is given; DP takes the other ranks; MoE layouts with TP > 1
run with sequence parallelism, as megatron's MoE layer requires in training).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModel, AutoModelForCausalLM

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pack, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.context_parallel import split_for_cp, split_packed_for_cp
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import ModelGroups, build_model_groups
from vapo_megatron.tiny.model import tiny_qwen3_config, train_tokenizer

LENGTHS = [(3, 9), (6, 2), (2, 5), (5, 7)]  # (prompt, response) per sample
HEADS = ("lm", "value")


def reference(family: str):
    tokenizer = train_tokenizer(["12+34=46", "Answer: 46", "7*8=56 and 9-3=6"], vocab_size=300)
    config = tiny_qwen3_config(tokenizer, moe=family == "qwen3_moe", num_layers=4)
    config.initializer_range = 0.1  # router logits far apart: no near-ties in the top-k
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).float().eval()
    trunk = AutoModel.from_config(config).float().eval()
    trunk.load_state_dict(policy.model.state_dict())
    score = torch.randn(1, config.hidden_size) * 0.1
    gen = torch.Generator().manual_seed(1)
    samples, logits, values = [], [], []
    for n_prompt, n_resp in LENGTHS:
        tokens = torch.randint(0, config.vocab_size, (n_prompt + n_resp,), generator=gen)
        samples.append(Sample(tokens[:n_prompt].tolist(), tokens[n_prompt:].tolist()))
        with torch.no_grad():
            logits.append(policy(tokens[None]).logits[0])
            values.append(trunk(tokens[None]).last_hidden_state[0] @ score.T)
    policy_sd = checkpoint_tensors(policy)
    critic_sd = {k: v for k, v in policy_sd.items() if k != "lm_head.weight"} | {
        "score.weight": score
    }
    hf = HFModelConfig.from_hf(config.to_dict())
    return hf, samples, {"lm": (logits, policy_sd), "value": (values, critic_sd)}


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` under the names transformers writes to disk: transformers 5
    holds a Qwen3-MoE layer's experts fused in memory (``experts.gate_up_proj`` [E, 2f, h],
    ``experts.down_proj`` [E, h, f]) and writes the published per-expert names
    (``experts.{e}.gate_proj.weight`` [f, h], ``up_proj``, ``down_proj`` [h, f]), as checked
    with ``save_pretrained`` (not called here: under torch.distributed only rank 0 writes)."""
    out = {}
    for name, tensor in model.state_dict().items():
        prefix, _, last = name.rpartition(".")
        if last == "gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
        elif last == "down_proj" and tensor.dim() == 3:
            for e, down in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = down.clone()
        else:
            out[name] = tensor
    return out


def gather_full(local: torch.Tensor, mb, groups: ModelGroups) -> torch.Tensor:
    """This micro-batch's output over the full rows: TP slices joined, CP shards merged."""
    tp, cp = groups.pg_collection.tp, groups.pg_collection.cp
    if groups.tp_size > 1 and local.shape[-1] > 1:  # vocab-parallel logits
        parts = [torch.empty_like(local) for _ in range(groups.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=tp)
        local = torch.cat(parts, dim=-1)
    if groups.cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(groups.cp_size)]
    dist.all_gather(parts, local.contiguous(), group=cp)
    if mb.packed_seq_params is None:  # [b, s / cp, v] shards in the load-balanced layout
        width = local.shape[1] * groups.cp_size
        full = local.new_zeros(local.shape[0], width, local.shape[-1])
        for rank, part in enumerate(parts):
            full[:, split_for_cp(torch.arange(width)[None], groups.cp_size, rank)[0]] = part
        return full
    cu = mb.packed_seq_params.cu_seqlens_q_padded
    full = local.new_zeros(1, int(cu[-1]), local.shape[-1])
    for rank, part in enumerate(parts):
        index = split_packed_for_cp(torch.arange(int(cu[-1])), cu, groups.cp_size, rank)
        full[0, index] = part[0]
    return full


def rows_of(full: torch.Tensor, mb, count: int) -> list[torch.Tensor]:
    """Per-sample outputs [len, v] (real tokens only) from a micro-batch's full output."""
    if mb.packed_seq_params is None:
        return [full[b] for b in range(count)]
    cu = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
    return [full[0, cu[i] : cu[i + 1]] for i in range(count)]


def check(name: str, hf: HFModelConfig, samples, refs) -> None:
    tp, pp, cp, ep, *vpp = (int(v) for v in name.split("x"))  # a fifth field: vpp
    sp = hf.is_moe and tp > 1
    layout = ModelLayout(
        tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp[0] if vpp else None, sequence_parallel=sp
    )
    groups = build_model_groups(tp=tp, pp=pp, cp=cp, ep=ep)
    for head in HEADS:
        want_all, sd = refs[head]
        engine = ModelEngine(hf, layout, head=head, optim=OptimSettings(), groups=groups)
        engine.load_hf(sd)
        for make in (pad, pack):
            mbs = [
                make(samples[i : i + 2], cp_size=cp, cp_rank=groups.cp_rank, pad_multiple=8)
                for i in (0, 2)
            ]
            outs = engine.run(
                mbs, lambda out, mb: (out.sum() * 0, {"out": out.detach()}), forward_only=True
            )
            if not groups.is_last_stage:
                continue
            worst = 0.0
            for i, (mb, out) in enumerate(zip(mbs, outs, strict=True)):
                full = gather_full(out["out"], mb, groups)
                for j, got in enumerate(rows_of(full, mb, 2)):
                    want = want_all[2 * i + j]
                    got = got[: want.shape[0], : want.shape[-1]]
                    worst = max(worst, (got - want).abs().max().item())
                    if head == "lm":  # padded vocabulary rows stay exactly zero
                        assert not full[..., hf.vocab_size :].any()
            assert worst < 2e-5, f"{name} {head} {make.__name__}: max diff {worst}"
            print(f"rank {dist.get_rank()}: {name} {head} {make.__name__}: max diff {worst:.2e}")


def main() -> None:
    initialize_cpu_process_group()
    hf, samples, refs = reference(sys.argv[1])
    for name in sys.argv[2].split(","):
        check(name, hf, samples, refs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
