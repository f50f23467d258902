"""The CPU route recorder against vLLM's native ``routed_experts`` contract and transformers.

vLLM's CPU build cannot return routes itself (Model Runner V2 needs Triton); the recorder
hooks the engine's routers in this process. Its output must be the native layout:
int16 [prompt + response - 1, layers, top_k] per sample, one row per forwarded token in
sequence order (the last response token is never forwarded), and each row the top-k the
model's router picks for that token: checked against transformers' router logits of the same
weights on the same tokens, for several requests batched together and for n > 1 samples.
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
transformers = pytest.importorskip("transformers")

from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from vapo_megatron.rollout.route_recorder import ROUTE_DTYPE  # noqa: E402
from vapo_megatron.rollout.vllm_args import route_recording  # noqa: E402

pytestmark = pytest.mark.integration

LAYERS, EXPERTS, TOP_K, VOCAB = 2, 4, 2, 96


def make_qwen3_moe(path, seed=0):
    """A random tiny Qwen3-MoE (fp32, head_dim 64 for vLLM's CPU attention) saved to ``path``."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # wide router weights: no near-ties between experts
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def hf_routes(model, tokens):
    """[len(tokens), layers, top_k] experts transformers' routers choose, best first."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    logits = torch.stack([layer.reshape(len(tokens), EXPERTS) for layer in out.router_logits], 1)
    return logits.topk(TOP_K, dim=-1).indices


@pytest.mark.slow  # ~60 s on 2 busy cores; tests/integration/trainer/test_routing_replay.py
# checks the same contract in the default run
def test_recorded_routes_follow_the_native_layout_and_transformers(tmp_path):
    model = make_qwen3_moe(tmp_path)
    engine = RolloutEngine(
        RolloutConfig(
            model_path=str(tmp_path), dtype="float32", max_model_len=256, record_routes=True
        )
    )
    try:
        prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
        samples = engine.generate(prompts, n=2, temperature=1.0, max_new_tokens=9, seed=11)
    finally:
        engine.shutdown()
    assert len(samples) == 4
    for sample in samples:
        prompt, response = prompts[sample.prompt_index], list(sample.response_token_ids)
        tokens = prompt + response
        routes = sample.routes
        assert routes.dtype == ROUTE_DTYPE
        assert tuple(routes.shape) == (len(tokens) - 1, LAYERS, TOP_K)
        expected = hf_routes(model, tokens[:-1])
        assert torch.equal(routes.long(), expected), (sample.prompt_index, sample.sample_index)


def test_start_arguments():
    assert route_recording(False, is_cpu=True, executor="uni") == {}
    assert route_recording(True, is_cpu=False, executor="external_launcher") == {
        "enable_return_routed_experts": True
    }
    assert route_recording(True, is_cpu=True, executor="uni") == {"enable_prefix_caching": False}
    with pytest.raises(ValueError, match="'mp' executor"):
        route_recording(True, is_cpu=True, executor="mp")
