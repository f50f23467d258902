"""The trainer's engines skip megatron's random initialisation (every parameter is loaded
next), while an engine built without weights to load is still initialised; skipping keeps
every tensor-parallel attribute megatron sets (``perform_initialization=False`` would drop
them from the local spec's weights, and the gradient norm reads them)."""

import pytest
import torch
import torch.distributed as dist

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.optim import OptimSettings
from vapo_megatron.config.recipe import config_from_dict
from vapo_megatron.engine.model_engine import ModelEngine
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import apply_cpu_shim
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.trainer.session import build_engine

pytestmark = pytest.mark.unit
HF = HFModelConfig.from_hf(
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
     "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
)  # fmt: skip
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shim()
    yield


def built(make) -> tuple[ModelEngine, bool]:
    """The engine ``make()`` builds and whether building it drew from the generator that
    megatron's CPU initialisation (``use_cpu_initialization``) draws from."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    engine = make()
    return engine, not torch.equal(torch.get_rng_state(), before)


def tp_attributes(engine: ModelEngine) -> dict[str, tuple]:
    return {
        name: tuple(getattr(p, a, None) for a in TP_ATTRIBUTES)
        for chunk in engine.chunks
        for name, p in chunk.named_parameters()
    }


@pytest.mark.parametrize("role, head", [("policy", "lm"), ("critic", "value")])
def test_trainer_engines_skip_the_random_init_that_plain_engines_do(role, head):
    config = config_from_dict({"model": {"path": "m", "dtype": "float32"},
                               "data": {"train_path": "t.jsonl"}})  # fmt: skip
    groups = build_model_groups(tp=1, pp=1, cp=1)
    # The session's build: its weights are loaded next, so nothing is drawn.
    loaded, drew = built(lambda: build_engine(config, HF, role, groups))
    assert not drew
    # Built plainly (tests, benchmarks that train from random weights): initialised.
    plain, drew = built(
        lambda: ModelEngine(HF, ModelLayout(), head=head, optim=OptimSettings(), groups=groups)
    )
    assert drew
    weights = dict(plain.chunks[0].named_parameters())
    qkv = next(p for n, p in weights.items() if n.endswith("linear_qkv.weight"))
    assert 0.01 < qkv.std().item() < 0.03  # megatron's init_method_std 0.02 (HF's range)
    # Every parameter keeps the TP attributes megatron sets, as in the initialised engine.
    have, want = tp_attributes(loaded), tp_attributes(plain)
    assert have == want
    assert sum(v[0] is True for v in want.values()) >= 8, want
    if head == "value":  # the project's own head is made as always: zeros (V = 0)
        head_weight = loaded.chunks[0].module.output_layer.weight
        assert torch.count_nonzero(head_weight) == 0
