"""Worker: Megatron GPTModels loaded through the record give transformers' logits, on gloo.

Usage: python record_worker.py OUT_DIR   (run as 4 ranks). Every rank builds the same
random-weight transformers models (Qwen2 untied, Qwen2 tied, Llama 3 with llama3 RoPE
scaling), then, for each layout TPxPP[xVPP] (data parallelism takes the remaining ranks),
builds megatron-core GPTModel chunks with the local layer spec, loads the shards the record
makes for this rank, runs the forward pass through megatron's pipeline schedule
(``get_forward_backward_func``, forward only) and compares the logits of the last stage with
transformers'. Each rank writes what it measured to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.weights.record import ModelChunk, ModelRecord

LAYOUTS = [(1, 1, None), (2, 1, None), (4, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
BATCH, SEQ, VOCAB = 2, 32, 250
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=16384,
)


def hf_models() -> dict[str, transformers.PreTrainedModel]:
    configs = {
        "qwen2": transformers.Qwen2Config(
            **COMMON, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}
        ),
        "qwen2-tied": transformers.Qwen2Config(
            **COMMON,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
            tie_word_embeddings=True,
        ),
        "llama3": transformers.LlamaConfig(
            **COMMON,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_theta": 5e5,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    }
    models = {}
    for seed, (name, config) in enumerate(configs.items()):
        cls = transformers.LlamaForCausalLM if name == "llama3" else transformers.Qwen2ForCausalLM
        model = cls(config).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # weights large enough that every mapping error shows in the logits
            for param_name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen)
                if param_name.endswith("norm.weight"):
                    param.copy_(1 + 0.2 * noise)
                elif param.dim() == 1:
                    param.copy_(0.2 * noise)
                else:
                    param.copy_(noise / param.shape[1] ** 0.5)
        models[name] = model
    return models


def hf_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes: a tied lm_head is left out."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        lm_head = state.pop("lm_head.weight")
        assert lm_head.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    return state


def megatron_logits(
    record: ModelRecord, hf_state: dict, tp: int, pp: int, vpp: int | None, tokens: torch.Tensor
) -> torch.Tensor | None:
    """[BATCH, SEQ, padded vocab] on the last pipeline stage, else None."""
    config = TransformerConfig(
        **record.config.transformer_config_kwargs(),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
    )
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            parallel_output=False,
            vp_stage=vp_stage,
            **record.config.gpt_model_kwargs(tp),
        )
        chunk = ModelChunk.for_stage(config, pp_rank, vp_stage)
        shards = record.hf_to_megatron_shards(hf_state, tp_rank, tp, chunk)
        params = {name for name, _ in model.named_parameters()}
        assert params == set(shards), f"record {sorted(set(shards) ^ params)}"
        missing, unexpected = model.load_state_dict(shards, strict=False)
        assert not unexpected and all(k.endswith("._extra_state") for k in missing), missing
        chunks.append(model.eval())

    positions = torch.arange(SEQ).expand(1, SEQ)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), positions, attention_mask=None)
        return output, lambda out, non_loss_data=False: out.detach().clone()

    # One micro-batch per sequence: activations cross the pipeline several times.
    iterators = [iter(tokens.split(1)) for _ in chunks]
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if vpp else iterators[0],
        model=chunks if vpp else chunks[0],
        num_microbatches=BATCH,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=True,
        collect_non_loss_data=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(outputs)


def main(out_dir: Path) -> None:
    models = hf_models()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = {name: model(tokens).logits for name, model in models.items()}
        # How much the llama3 RoPE scaling moves these logits: what the check can detect.
        plain_rope = copy.deepcopy(models["llama3"].config)
        plain_rope.rope_parameters = {"rope_theta": 5e5, "rope_type": "default"}
        unscaled = transformers.LlamaForCausalLM(plain_rope)
        unscaled.load_state_dict(models["llama3"].state_dict())
        rope_scaling_effect = (unscaled(tokens).logits - reference["llama3"]).abs().max().item()

    results: dict = {"rope_scaling_effect": rope_scaling_effect, "checks": {}}
    for tp, pp, vpp in LAYOUTS:
        initialize_megatron_cpu(tp=tp, pp=pp, vpp=vpp)
        layout = f"TP{tp}xPP{pp}" + (f"xVPP{vpp}" if vpp else "")
        for name, model in models.items():
            record = ModelRecord(HFModelConfig.from_hf(model.config.to_dict()))
            logits = megatron_logits(record, hf_state_dict(model), tp, pp, vpp, tokens)
            if logits is None:
                continue
            padded = record.config.padded_vocab_size(tp)
            assert logits.shape == (BATCH, SEQ, padded), logits.shape
            results["checks"][f"{name} {layout}"] = {
                "max_abs_diff": (logits[..., :VOCAB] - reference[name]).abs().max().item(),
                "max_abs_logit": reference[name].abs().max().item(),
                "padding_logits_zero": bool((logits[..., VOCAB:] == 0).all()),
            }
    (out_dir / f"rank{int(os.environ['RANK'])}.json").write_text(json.dumps(results, indent=1))
    destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
