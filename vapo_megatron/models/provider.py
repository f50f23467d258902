"""Build the policy (LM head) and the critic (value head) as megatron-core GPTModels.

One HF config and one layout give the model chunks of this rank: one chunk, or one per
virtual pipeline stage. Policy and critic take independent layouts. Layer specs: Transformer
Engine's on a GPU when it is installed, else megatron-core's local spec with the project's core
attention (context parallelism and packed sequences without Transformer Engine). The two name
the layer norms' parameters differently: ``layer_spec_kind`` tells the model record which names
a built model has. On a GPU without TE the local spec's dense attention refuses context
parallelism and long rows (``check_local_attention_fits``).

Qwen3 adds per-head q/k norms (``qk_layernorm``: the project's RMSNorm in the local spec, TE's
norm in TE's); Qwen3-MoE replaces every MLP by megatron's ``MoELayer``: ``SequentialMLP``
experts in the local spec (the CPU path), ``TEGroupedMLP`` (grouped GEMM) in TE's when
``gpu.moe_grouped_gemm`` resolves on (``uses_grouped_experts`` tells which). The MoE layer's
pre-MLP norm stays a module of its own under TE (megatron's MoE spec does not fuse it), so the
local spec's checkpoint key map leaves it under its own name (``moe_keys_map``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from vapo_megatron.config.gpu import ResolvedGpuSettings
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.config.moe import MoESettings
from vapo_megatron.models.config import Head, HFModelConfig, LayerSpecKind
from vapo_megatron.models.megatron_patches import apply_megatron_patches
from vapo_megatron.models.mtp import MTPGPTModel, mtp_block_spec
from vapo_megatron.models.norm import RMSNorm
from vapo_megatron.models.value_head import ValueHead
from vapo_megatron.parallel.devices import init_device
from vapo_megatron.parallel.moe_cpu_shim import apply_moe_cpu_shim

logger = logging.getLogger(__name__)


INIT_METHODS = ("init_method", "output_layer_init_method", "embedding_init_method")
"""The TransformerConfig fields that hold megatron's weight initialisers."""


def leave_uninitialised(weight: torch.Tensor) -> None:
    """An init method that leaves ``weight`` as allocated: no kernel, no random draw.

    Not ``perform_initialization=False``: with it megatron-core 0.16.1's local layers
    (``tensor_parallel/layers.py``) also skip ``set_tensor_model_parallel_attributes``, so a
    TP-split weight loses ``tensor_model_parallel``/``partition_dim``/``partition_stride`` and
    the gradient norm (``param_is_not_tensor_parallel_duplicate``) counts it on TP rank 0
    only. With this, megatron (and Transformer Engine) call the init method as usual and set
    every attribute; biases are still zeroed and the project's norms (ones) and value head
    (zeros) are made as always."""


def transformer_config(
    hf: HFModelConfig,
    layout: ModelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    gpu: ResolvedGpuSettings | None = None,
    recompute: dict[str, object] | None = None,
    initialize: bool = True,
    moe: MoESettings | None = None,
    mtp: bool = False,
) -> TransformerConfig:
    """The TransformerConfig of ``hf`` under ``layout`` (fp32 or bf16 parameters).

    ``moe``: an MoE model's router losses, router dtype and dispatcher (None: the defaults of
    :class:`MoESettings`); the expert-parallel sizes come from ``layout.ep`` / ``etp``. A dense
    model ignores both, and the GPU switches of experts (grouped GEMM, permute fusion).

    ``gpu``: the fusions :func:`gpu_settings.resolve` chose; None leaves megatron-core's
    defaults (every fusion off), as on CPU. ``recompute``: the ``recompute_*`` fields
    (``RecomputeSettings.transformer_config_kwargs()``); None: no activation recompute.
    ``initialize``: False when every parameter is loaded right after the build (a checkpoint
    or HF weights): megatron's random initialisation is skipped (:func:`leave_uninitialised`).
    ``mtp``: the model holds ``hf.mtp_num_layers`` multi-token-prediction layers on its last
    stage (``models/mtp.py``; a policy with ``policy.mtp.loss_weight`` > 0).
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype must be float32 or bfloat16, got {params_dtype}")
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    skip = {} if initialize else dict.fromkeys(INIT_METHODS, leave_uninitialised)
    fusions = gpu.transformer_config_kwargs() if gpu is not None else {}
    experts: dict[str, object] = {}
    if hf.is_moe:
        experts = {
            "expert_model_parallel_size": layout.ep,
            "expert_tensor_parallel_size": layout.expert_tp,
        }
    else:
        fusions = {k: v for k, v in fusions.items() if not k.startswith("moe_")}
    config_class = MLATransformerConfig if hf.mla is not None else TransformerConfig
    return config_class(
        **hf.transformer_config_kwargs(moe),
        **experts,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu_initialization,
        # Interleaved PP with batched p2p gives wrong results once micro-batches > PP
        # (MEGATRON_ON_CPU.md, traps); the overlapped unbatched path is exact.
        overlap_p2p_comm=layout.vpp is not None,
        batch_p2p_comm=layout.vpp is None,
        **fusions,
        **(recompute or {}),
        **skip,
        **_mtp_kwargs(hf, mtp),
    )


def _mtp_kwargs(hf: HFModelConfig, mtp: bool) -> dict[str, object]:
    """The MTP fields of the TransformerConfig; ValueError for a model without MTP layers."""
    if not mtp:
        return {}
    if not hf.mtp_num_layers:
        raise ValueError(
            f"the {hf.family} model has no multi-token-prediction layers "
            "(num_nextn_predict_layers=0): build it with mtp=False (policy.mtp.loss_weight=0)"
        )
    # The loss factor is megatron's own MTP loss, which MTPGPTModel never runs.
    return {"mtp_num_layers": hf.mtp_num_layers, "mtp_loss_scaling_factor": 0.0}


def default_layer_spec(
    hf: HFModelConfig | None = None, *, grouped_gemm: bool = False
) -> ModuleSpec:
    """Transformer Engine's layer spec on a GPU with TE installed, else (with a logged warning
    on a GPU) :func:`local_spec`. ``layer_spec_kind`` tells which one a spec is.

    ``hf``: the model (qk norms, experts); None: a dense model without qk norms (Qwen2,
    Llama). ``grouped_gemm``: TE's grouped-GEMM experts (``gpu.moe_grouped_gemm`` resolved);
    the local spec has SequentialMLP experts whatever it says.

    Without TE, megatron-core 0.16.1's ``get_gpt_layer_with_transformer_engine_spec()`` raises
    ``NameError('TESpecProvider')`` (its TE imports failed quietly at import time), so TE is
    looked for first and both that and an ImportError mean "no TE"."""
    if torch.cuda.is_available():
        if importlib.util.find_spec("transformer_engine") is None:
            reason = "transformer_engine is not installed"
        else:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            try:
                return get_gpt_layer_with_transformer_engine_spec(
                    num_experts=hf.num_experts or None if hf is not None else None,
                    moe_grouped_gemm=grouped_gemm,
                    qk_layernorm=hf is not None and hf.qk_layernorm,
                    multi_latent_attention=hf is not None and hf.mla is not None,
                )
            except (ImportError, NameError) as err:  # installed but not importable
                reason = f"megatron-core cannot use it ({type(err).__name__}: {err})"
        logger.warning(
            "CUDA is available but %s: using megatron-core's local layer spec with dense "
            "attention, which refuses context parallelism and rows over %d tokens on a GPU; "
            "install transformer-engine[pytorch] for training at scale",
            reason,
            LOCAL_ATTENTION_MAX_TOKENS,
        )
    return local_spec(hf)


def local_spec(hf: HFModelConfig | None = None) -> ModuleSpec:
    """megatron-core's local layer spec with the project's core attention (context parallelism
    and packed sequences without TE) and RMSNorm (HF numerics; sequence parallelism), for the
    model ``hf`` (None: dense, no qk norms): its q/k norms are the same RMSNorm (over
    head_dim), its MoE layers megatron's with SequentialMLP experts and checkpoint keys as
    TE's MoE layers have them (:func:`moe_keys_map`)."""
    from vapo_megatron.models.layer_spec import local_layer_spec

    mla = hf is not None and hf.mla is not None
    spec = local_layer_spec(
        qk_layernorm=hf is not None and hf.qk_layernorm,
        num_experts=hf.num_experts or None if hf is not None else None,
        multi_latent_attention=mla,
    )
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if spec.submodules.mlp.module is MoELayer:
        spec.submodules.sharded_state_dict_keys_map = moe_keys_map(
            spec.submodules.sharded_state_dict_keys_map
        )
    if hf is not None and hf.qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = RMSNorm
        if mla:  # the compressed query's and key/value's norms (q_a/kv_a_layernorm)
            attention.kv_layernorm = RMSNorm
        else:
            attention.k_layernorm = RMSNorm
    return spec


def dense_layer_spec(spec: ModuleSpec, kind: LayerSpecKind) -> ModuleSpec:
    """The dense-MLP layer of an MoE model's layer spec ``spec`` (DeepSeek-V3/GLM-4.5's first
    ``first_k_dense`` layers): the same attention and norms, megatron's ``MLP`` of the spec's
    kind. Under TE the pre-MLP norm fuses into fc1 as in a dense model; the local spec keeps
    its norm module, whose checkpoint key is TE's fused name as in a dense local layer."""
    sub = spec.submodules
    mlp = get_mlp_module_spec(use_te=kind == "te", num_experts=None)
    keys_map = dict(sub.sharded_state_dict_keys_map)
    pre_mlp = sub.pre_mlp_layernorm
    if kind == "te":
        pre_mlp = IdentityOp
    else:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    dense = dataclasses.replace(
        sub, mlp=mlp, pre_mlp_layernorm=pre_mlp, sharded_state_dict_keys_map=keys_map
    )
    return dataclasses.replace(spec, submodules=dense)


def moe_keys_map(keys_map: dict[str, str]) -> dict[str, str]:
    """The local spec's checkpoint key map for an MoE layer: ``keys_map`` without its
    ``pre_mlp_layernorm.`` entry.

    megatron-core 0.16.1's ``get_gpt_layer_local_spec`` maps ``input_layernorm.`` to
    ``self_attention.linear_qkv.layer_norm_`` and ``pre_mlp_layernorm.`` to
    ``mlp.linear_fc1.layer_norm_`` whatever the MLP, so that its checkpoints carry Transformer
    Engine's names (TE fuses each norm into the linear after it). Its TE spec
    (``get_gpt_layer_with_transformer_engine_spec``) fuses the pre-MLP norm of a dense MLP only:
    an MoE layer gets ``pre_mlp_layernorm=backend.layer_norm()`` (TENorm, its own module; the
    MoE spec says ``fuse_pre_mlp_layernorm: False``) and saves ``pre_mlp_layernorm.weight``,
    and an MoE layer has no ``linear_fc1`` at all. Kept, the entry would write the local
    model's norm under a key no TE model loads."""
    return {k: v for k, v in keys_map.items() if k != "pre_mlp_layernorm."}


def layer_spec_kind(spec: ModuleSpec) -> LayerSpecKind:
    """'te' for Transformer Engine's GPT layer spec (each norm fused into the next linear,
    ``TELayerNormColumnParallelLinear``, no norm modules of its own; an MoE layer keeps its
    pre-MLP norm, which megatron does not fuse into the router), 'local' for a spec with
    separate norm modules and no fused norm (megatron's local spec, :func:`local_spec`): the
    ``layer_spec`` of the model's ``ModelRecord``. ValueError for anything else (e.g. TE's op
    fuser MLP), whose parameter names the record does not know."""
    sub = spec.submodules
    if _is_mla(spec):
        return _mla_spec_kind(spec)
    norms = [getattr(x, "module", x) for x in (sub.input_layernorm, sub.pre_mlp_layernorm)]
    mlp = getattr(sub.mlp, "module", None)
    linears = [sub.self_attention.submodules.linear_qkv]
    if mlp is MLP:
        linears.append(sub.mlp.submodules.linear_fc1)
    fused = [_is_te_norm_linear(getattr(x, "module", x)) for x in linears]
    no_norms = [norm is IdentityOp for norm in norms]
    if mlp is MoELayer:  # no fused MLP norm: only the attention's input norm can be fused
        if fused == [True] and no_norms == [True, False]:
            return "te"
        if fused == [False] and no_norms == [False, False]:
            return "local"
    elif mlp is MLP and all(fused) and all(no_norms):
        return "te"
    elif mlp is MLP and not any(fused) and not any(no_norms):
        return "local"
    raise ValueError(
        f"layer spec with norms {norms}, MLP {getattr(sub.mlp, 'module', sub.mlp)} and linears "
        f"{linears}: the model record knows the parameter names of megatron-core's local GPT "
        "spec and of get_gpt_layer_with_transformer_engine_spec() (without the op fuser) only"
    )


def _is_mla(spec: ModuleSpec) -> bool:
    return getattr(spec.submodules.self_attention, "module", None) is MLASelfAttention


def _mla_spec_kind(spec: ModuleSpec) -> LayerSpecKind:
    """An MLA layer's kind: TE fuses the q/kv norms into ``linear_q_up_proj`` /
    ``linear_kv_up_proj`` and keeps ``input_layernorm`` (gpt_layer_specs.py, MLA branch);
    the local spec has every norm a module (the MoE layer of either keeps its pre-MLP norm)."""
    attention = spec.submodules.self_attention.submodules
    up = [
        getattr(x, "module", x) for x in (attention.linear_q_up_proj, attention.linear_kv_up_proj)
    ]
    fused = [_is_te_norm_linear(x) for x in up]
    if all(fused):
        return "te"
    if not any(fused) and attention.kv_layernorm not in (None, IdentityOp):
        return "local"
    raise ValueError(
        f"MLA layer spec with up projections {up} and kv norm {attention.kv_layernorm}: the "
        "model record knows megatron-core's local MLA spec (qk_layernorm=True) and TE's"
    )


def uses_grouped_experts(spec: ModuleSpec) -> bool:
    """Whether the spec's MoE experts are one grouped-GEMM module (TE's ``TEGroupedMLP``,
    weights ``linear_fc1.weight{j}``) rather than ``SequentialMLP`` (``local_experts.{j}``);
    False for a dense spec. The ``grouped_experts`` of the model's ``ModelRecord``."""
    mlp = spec.submodules.mlp
    if getattr(mlp, "module", None) is not MoELayer:
        return False
    experts = getattr(mlp.submodules.experts, "module", mlp.submodules.experts)
    return experts.__name__ in ("TEGroupedMLP", "GroupedMLP")


def check_spec_fits(hf: HFModelConfig, spec: ModuleSpec) -> None:
    """ValueError when the layer spec lacks what ``hf`` computes (qk norms, experts) or has
    what it does not: the model would build and load, then compute something else."""
    attention = spec.submodules.self_attention.submodules
    mla = _is_mla(spec)
    if mla and layer_spec_kind(spec) == "te":
        has_qk = True  # fused into the up projections
    else:
        has_qk = attention.q_layernorm not in (None, IdentityOp)
    has_moe = getattr(spec.submodules.mlp, "module", None) is MoELayer
    want_mla = hf.mla is not None
    if has_qk != hf.qk_layernorm or has_moe != hf.is_moe or mla != want_mla:
        raise ValueError(
            f"the layer spec has qk norms={has_qk}, MoE={has_moe} but the {hf.family} model "
            f"has qk norms={hf.qk_layernorm}, MoE={hf.is_moe} (latent attention: spec {mla}, "
            f"model {want_mla}): build the spec for this model (default_layer_spec(hf) or "
            "local_spec(hf))"
        )


def _is_te_norm_linear(cls: object) -> bool:
    # By name: TE's classes exist only where TE is installed.
    return any(c.__name__ == "TELayerNormColumnParallelLinear" for c in getattr(cls, "__mro__", ()))


LOCAL_ATTENTION_MAX_TOKENS = 8192
"""Longest row (tokens of one padded sequence, or of one packed THD row) that the local spec's
dense attention takes on a GPU. ``models/attention.py`` materialises, per layer and per
attention head of the rank, an [s, s] score matrix: at s = 8192 that is 256 MiB in fp32, and
the forward pass makes about four of them (the product, its fp32 scaled and masked copies, the
softmax) while autograd keeps 1.5 (the fp32 softmax and its bf16 copy) per layer until the
backward pass. With Qwen2.5-32B at TP 8 (5 query heads per rank) that is ~5 GiB of transient
forward memory and ~1.9 GiB kept per layer at 8192 tokens; the paper's rows (20480 response +
prompt, ~22k tokens) cost (22528 / 8192)^2 = 7.6 times more: ~14 GiB kept per layer, which no
GPU holds over a pipeline stage of layers. The bound lets small models and short rows run on a
GPU without TE (smoke tests, debugging); it does not promise that every row under it fits."""


def check_local_attention_fits(
    layer_spec: LayerSpecKind,
    *,
    cp: int,
    row_tokens: int | None = None,
    on_cuda: bool | None = None,
) -> None:
    """ValueError, saying why and what to change, where the local spec's dense attention cannot
    serve a GPU run: context parallelism > 1, or a row longer than
    :data:`LOCAL_ATTENTION_MAX_TOKENS` (``row_tokens``: the longest row of a micro-batch,
    padded [b, s] length s or packed THD row length; None checks the layout only). Nothing is
    refused under Transformer Engine's spec, or on the CPU (``on_cuda``: default
    ``torch.cuda.is_available()``), where the dense attention is the development path."""
    if layer_spec != "local":
        return
    if on_cuda is None:
        on_cuda = torch.cuda.is_available()
    if not on_cuda:
        return
    if cp > 1:
        raise ValueError(
            f"context parallelism cp={cp} on a GPU needs Transformer Engine's attention: the "
            "local spec's dense attention all-gathers K/V and holds a [tokens/cp, tokens] score "
            "matrix per head, meant for CPU tests; install transformer-engine[pytorch], or set "
            "cp=1 and keep rows within "
            f"{LOCAL_ATTENTION_MAX_TOKENS} tokens"
        )
    if row_tokens is not None and row_tokens > LOCAL_ATTENTION_MAX_TOKENS:
        raise ValueError(
            f"a row of {row_tokens} tokens is over the {LOCAL_ATTENTION_MAX_TOKENS} that the "
            "local spec's dense attention takes on a GPU (it holds an fp32 [tokens, tokens] "
            "score matrix per head and layer: 256 MiB per head at 8192 tokens, growing with the "
            "square of the length); install transformer-engine[pytorch], or lower "
            "micro_batch_tokens and the prompt/response max lengths so that rows stay within "
            f"{LOCAL_ATTENTION_MAX_TOKENS} tokens"
        )


def _block_spec(
    config: TransformerConfig, layer_spec: ModuleSpec, vp_stage: int | None, pp_rank: int
):
    """Layer spec -> block spec. With our RMSNorm in the layers, the final norm is ours too
    (megatron's default final norm is the torch fallback, which refuses sequence parallelism).
    An MoE model with dense layers (``moe_layer_freq`` a list: DeepSeek-V3, GLM-4.5) gets
    :func:`dense_layer_spec` at its dense layers; under TE megatron's own block spec, which
    builds the same two layer specs."""
    mixed = isinstance(config.moe_layer_freq, list)
    local = layer_spec.submodules.input_layernorm is RMSNorm
    if not local and not mixed:
        return layer_spec
    if not local:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm",
            vp_stage=vp_stage, pp_rank=pp_rank,
        )  # fmt: skip
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = [layer_spec] * count
    if mixed:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        dense = dense_layer_spec(layer_spec, "local")
        pattern = config.moe_layer_freq[offset : offset + count]
        specs = [layer_spec if is_moe else dense for is_moe in pattern]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def _check_mtp(config: TransformerConfig, head: Head) -> bool:
    """Whether the config asks for MTP layers; ValueError where megatron or this project
    cannot build or train them (critic, virtual pipeline, context parallelism)."""
    if not config.mtp_num_layers:
        return False
    if head != "lm":
        raise ValueError("a critic (value head) builds no MTP layers: make its config mtp=False")
    if config.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            f"MTP layers with vpp={config.virtual_pipeline_model_parallel_size}: megatron-core "
            "0.16.1 places them on the last virtual stage through parallel_state only; set "
            "policy.layout.vpp=null or policy.mtp.loss_weight=0"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"MTP layers with cp={config.context_parallel_size}: the MTP loss's targets are not "
            "shifted across CP chunks here; set policy.layout.cp=1 or policy.mtp.loss_weight=0"
        )
    return True


def _mtp_block(config: TransformerConfig, block, layer_spec: ModuleSpec) -> dict[str, object]:
    """GPTModel's ``mtp_block_spec`` argument on the last stage (megatron places every MTP
    layer there): each depth around the decoder's last layer spec (an MoE layer)."""
    last = block.layer_specs[-1] if hasattr(block, "layer_specs") else block
    kind = layer_spec_kind(layer_spec)
    return {"mtp_block_spec": mtp_block_spec(last, kind, config.mtp_num_layers)}


def build_model(
    hf: HFModelConfig,
    config: TransformerConfig,
    *,
    head: Head,
    pg_collection: ProcessGroupCollection | None = None,
    layer_spec: ModuleSpec | None = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) of the policy or critic.

    A config with ``mtp_num_layers`` (``transformer_config(mtp=True)``, policy only) builds
    the last stage as :class:`models.mtp.MTPGPTModel` with the MTP block
    (``models/mtp.py``).

    ``pg_collection``: this model's groups (``ModelGroups.pg_collection``), with sizes equal to
    the config's; None reads ``parallel_state``'s (which must then hold the config's layout).
    For ``head='value'`` the last stage's output layer is a :class:`ValueHead` and the model
    returns values [b, s, 1]. ``layer_spec``: None picks :func:`default_layer_spec`; the
    model's record needs ``layer_spec_kind`` of the spec used. ValueError for CP > 1 on a GPU
    with the local spec (:func:`check_local_attention_fits`).
    """
    mtp = _check_mtp(config, head)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    sizes = {
        "tp": (pg_collection.tp.size(), config.tensor_model_parallel_size),
        "pp": (pg_collection.pp.size(), config.pipeline_model_parallel_size),
        "cp": (pg_collection.cp.size(), config.context_parallel_size),
    }
    if hf.is_moe:
        sizes["ep"] = (pg_collection.ep.size(), config.expert_model_parallel_size)
        sizes["etp"] = (pg_collection.expt_tp.size(), config.expert_tensor_parallel_size)
    if any(have != want for have, want in sizes.values()):
        raise ValueError(
            f"process groups (size, config size) {sizes} disagree: build the groups with the "
            f"layout the config was made from"
        )
    if layer_spec is None:
        layer_spec = default_layer_spec(hf, grouped_gemm=config.moe_grouped_gemm)
    check_spec_fits(hf, layer_spec)
    if hf.is_moe:
        apply_moe_cpu_shim()  # nothing on a GPU
    apply_megatron_patches()  # the model's own TP group in megatron's attention; MLA on CPU
    check_local_attention_fits(layer_spec_kind(layer_spec), cp=config.context_parallel_size)
    tp = config.tensor_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        pre = pp_rank == 0 and vp_stage == 0
        post = pp_rank == pp_size - 1 and vp_stage == (vpp or 1) - 1
        block = _block_spec(config, layer_spec, stage, pp_rank)
        extra = _mtp_block(config, block, layer_spec) if mtp and post else {}
        # Every stage an MTPGPTModel, so each takes the forward's mtp_heads.
        model = (MTPGPTModel if mtp else GPTModel)(
            config=config,
            transformer_layer_spec=block,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            vp_stage=stage,
            pg_collection=pg_collection,
            **hf.gpt_model_kwargs(tp, head),
            **extra,
        )
        if head == "value" and post:
            # Built as an LM first (megatron-core has no other output layer); the vocab-sized
            # layer is dropped here, before any optimizer or DDP buffer sees it.
            model.output_layer = ValueHead(
                config.hidden_size,
                sequence_parallel=config.sequence_parallel,
                tp_group=pg_collection.tp,
                device=init_device(config.use_cpu_initialization),
            )
        chunks.append(model)
    return chunks
