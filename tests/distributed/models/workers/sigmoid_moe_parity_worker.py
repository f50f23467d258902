"""Worker: DeepSeek-V3 (MLA, plain RoPE or YaRN) and GLM-4.5 (partial RoPE, q/k/v biases,
qk norms) tiny models through the production model path give transformers' logits (policy)
and values (critic trunk + score) at each (TP, PP, CP, EP) layout, padded and packed: the
first layer dense, shared experts, sigmoid routing with a non-zero expert bias, groups.

Usage: python sigmoid_moe_parity_worker.py FAMILY "1x1x1x1,2x1x1x1,1x2x1x1x2,..."  (FAMILY:
deepseek_v3, deepseek_v3_yarn or glm4_moe; layouts TP x PP x CP x EP, then VPP where a fifth
field is given, as ``qwen3_parity_worker.py``, whose check this runs).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModel, AutoModelForCausalLM

from tests.distributed.models.workers.qwen3_parity_worker import (
    LENGTHS,
    check,
    checkpoint_tensors,
)
from vapo_megatron.data.packing import Sample
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import initialize_cpu_process_group
from vapo_megatron.tiny.model import (
    tiny_deepseek_v3_config,
    tiny_glm4_moe_config,
    train_tokenizer,
)


def tiny_config(family: str):
    tokenizer = train_tokenizer(["12+34=46", "Answer: 46", "7*8=56 and 9-3=6"], vocab_size=300)
    if family == "glm4_moe":
        config = tiny_glm4_moe_config(tokenizer, num_layers=4)
    else:
        config = tiny_deepseek_v3_config(tokenizer, num_layers=4, yarn=family.endswith("yarn"))
    config.initializer_range = 0.1  # router scores far apart: no near-ties in the top-k
    return config


def reference(family: str):
    config = tiny_config(family)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config).float().eval()
    for layer in policy.model.layers[config.first_k_dense_replace :]:
        # A bias as large as the score gaps: the choice differs from the unbiased top-k.
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.05)
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


def main() -> None:
    initialize_cpu_process_group()
    hf, samples, refs = reference(sys.argv[1])
    for name in sys.argv[2].split(","):
        check(name, hf, samples, refs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
