"""Worker: a tiny DeepSeek-V3 with one multi-token-prediction layer built in megatron
(``ModelEngine(mtp_loss_weight>0)``, ``models/mtp.py``) gives, at each (TP, PP, CP, EP)
layout, padded and packed, transformers' main logits and the MTP head's logits of a
plain-torch reference made of transformers' modules:

    x = eh_proj(cat[enorm(embed(token[t + 1])), hnorm(h_t)])   h: the main model's output
    logits = lm_head(shared_head.norm(DeepseekV3DecoderLayer(x)))    (after its final norm)

(DeepSeek-V3's MTP module; megatron concatenates the embedding first, as vLLM's
deepseek_mtp.py does). The MTP head at the last position reads a token past the sequence,
so positions 0 .. n - 2 are compared.

GLM-4.5 (``glm4_moe``: the same MTP module around its own decoder layer, GQA with partial
RoPE) runs the same check.

Usage: python mtp_parity_worker.py "1x1x1x1,2x1x1x2,..." [deepseek_v3|glm4_moe]  (TP x PP x
CP x EP, as ``qwen3_parity_worker.py``).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.distributed.models.workers.qwen3_parity_worker import (
    LENGTHS,
    checkpoint_tensors,
    gather_full,
    rows_of,
)
from tests.distributed.models.workers.sigmoid_moe_parity_worker import tiny_config
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.data.packing import Sample, pack, pad
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.mtp import split_output
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.parallel.model_groups import build_model_groups

TOLERANCE = 2e-5


class MTPReference(torch.nn.Module):
    """The MTP layer ``layer`` (HF ``model.layers.{layer}``) of ``policy``'s family from
    transformers' modules (its decoder layer and RMSNorm classes), with random weights (norm
    gains around 1, a non-zero expert bias)."""

    def __init__(self, config, layer: int, gen: torch.Generator, policy):
        super().__init__()
        hidden = config.hidden_size
        norm = type(policy.model.norm)
        self.enorm = norm(hidden, config.rms_norm_eps)
        self.hnorm = norm(hidden, config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.decoder = type(policy.model.layers[-1])(config, layer_idx=layer)
        self.norm = norm(hidden, config.rms_norm_eps)
        with torch.no_grad():
            for name, param in self.named_parameters():
                noise = torch.randn(param.shape, generator=gen)
                if param.dim() == 1:
                    param.copy_(1.0 + 0.2 * noise)
                elif "experts" in name:  # fused in memory [E, out, in]
                    param.copy_(noise * param.shape[-1] ** -0.5)
                else:
                    param.copy_(noise * param.shape[-1] ** -0.5)
            bias = self.decoder.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)

    def hf_tensors(self, layer: int, policy) -> dict[str, torch.Tensor]:
        """The layer's tensors under DeepSeek-V3's checkpoint names (with its copies of the
        lm head and the embedding)."""
        out = {f"model.layers.{layer}.{k}": v for k, v in checkpoint_tensors(self.decoder).items()}
        prefix = f"model.layers.{layer}"
        out |= {
            f"{prefix}.enorm.weight": self.enorm.weight,
            f"{prefix}.hnorm.weight": self.hnorm.weight,
            f"{prefix}.eh_proj.weight": self.eh_proj.weight,
            f"{prefix}.shared_head.norm.weight": self.norm.weight,
            f"{prefix}.shared_head.head.weight": policy.lm_head.weight,
            f"{prefix}.embed_tokens.weight": policy.model.embed_tokens.weight,
        }
        return {k: v.detach().clone() for k, v in out.items()}

    @torch.no_grad()
    def forward(self, policy, tokens: torch.Tensor) -> torch.Tensor:
        """[n - 1, V] logits of token t + 2 at positions t < n - 1 of ``tokens`` [n]."""
        h = policy.model(tokens[None]).last_hidden_state[0, :-1]  # after the final norm
        emb = policy.model.embed_tokens(tokens[1:])
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], -1))[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        rope = policy.model.rotary_emb(x, positions)
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.decoder(
            x, attention_mask=causal, position_ids=positions, position_embeddings=rope
        )
        out = out[0] if isinstance(out, tuple) else out
        return policy.lm_head(self.norm(out))[0]


def reference(family: str = "deepseek_v3"):
    config = tiny_config(family)
    config.num_nextn_predict_layers = 1
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).float().eval()
    for layer in policy.model.layers[config.first_k_dense_replace :]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.05)
    gen = torch.Generator().manual_seed(2)
    mtp = MTPReference(config, config.num_hidden_layers, gen, policy).float().eval()
    samples, logits, mtp_logits = [], [], []
    for n_prompt, n_resp in LENGTHS:
        tokens = torch.randint(0, config.vocab_size, (n_prompt + n_resp,), generator=gen)
        samples.append(Sample(tokens[:n_prompt].tolist(), tokens[n_prompt:].tolist()))
        with torch.no_grad():
            logits.append(policy(tokens[None]).logits[0])
        mtp_logits.append(mtp(policy, tokens))
    tensors = checkpoint_tensors(policy) | mtp.hf_tensors(config.num_hidden_layers, policy)
    hf = HFModelConfig.from_hf(config.to_dict())
    assert hf.mtp_num_layers == 1
    return hf, samples, logits, mtp_logits, tensors


def check(name: str, hf: HFModelConfig, samples, logits, mtp_logits, tensors) -> None:
    tp, pp, cp, ep = (int(v) for v in name.split("x"))
    layout = ModelLayout(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=tp > 1)
    groups = build_model_groups(tp=tp, pp=pp, cp=cp, ep=ep)
    engine = ModelEngine(
        hf, layout, head="lm", optim=OptimSettings(), groups=groups, mtp_loss_weight=0.1
    )
    engine.load_hf(tensors)
    for make in (pad, pack):
        mbs = [
            make(samples[i : i + 2], cp_size=cp, cp_rank=groups.cp_rank, pad_multiple=8)
            for i in (0, 2)
        ]

        def keep(out, mb):
            main, heads = split_output(out)
            return main.sum() * 0, {"main": main.detach(), "mtp": heads[0].detach()}

        outs = engine.run(mbs, keep, forward_only=True, mtp_heads=True)
        if not groups.is_last_stage:
            continue
        worst = {"main": 0.0, "mtp": 0.0}
        for i, (mb, out) in enumerate(zip(mbs, outs, strict=True)):
            for which, want_all in (("main", logits), ("mtp", mtp_logits)):
                full = gather_full(out[which], mb, groups)
                for j, got in enumerate(rows_of(full, mb, 2)):
                    want = want_all[2 * i + j]
                    got = got[: want.shape[0], : want.shape[-1]]
                    worst[which] = max(worst[which], (got - want).abs().max().item())
        assert max(worst.values()) < TOLERANCE, f"{name} {make.__name__}: max diffs {worst}"
        print(
            f"rank {dist.get_rank()}: {name} {make.__name__}: max diff main "
            f"{worst['main']:.2e} mtp {worst['mtp']:.2e}"
        )


def main() -> None:
    initialize_cpu_process_group()
    reference_outputs = reference(*sys.argv[2:3])
    for name in sys.argv[1].split(","):
        check(name, *reference_outputs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
