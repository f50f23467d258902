"""The HF <-> Megatron record of a Qwen2/Qwen2.5 or Llama 3 model: names, shapes, TP splits.

Both families share one layout; ``HFModelConfig`` holds what differs (QKV bias, RoPE). The
record is the one place that knows how an HF tensor becomes Megatron shards and back;
``tools/convert.py`` and the rollout weight stream both go through it.

Names. Megatron names are the parameter names (``named_parameters()``) of megatron-core's
``GPTModel`` as one model chunk (a pipeline stage, or one virtual stage under interleaving)
names them: layers are numbered locally, ``decoder.layers.{i}`` holding global layer
``chunk.layers[i]`` (megatron's ``layer.layer_number - 1``). With ``ModelChunk.whole`` that is
the TP=1 numbering. They depend on the layer spec the model was built with
(``ModelRecord.layer_spec``, from ``provider.layer_spec_kind``): the local spec has norm modules
of its own; Transformer Engine's spec (``get_gpt_layer_with_transformer_engine_spec``) fuses
each norm into the linear after it (``TELayerNormColumnParallelLinear``), so the two layer norms
are named after that linear. Every other name is the same under both specs: TE's linears keep
``weight``/``bias`` (a linear without bias registers no ``bias`` parameter), TE's final RMSNorm
keeps ``weight``, and the embedding and output layer are megatron's own modules either way.
State dicts also hold ``_extra_state`` entries (TE's FP8 metadata; megatron's local linears
write None), which are not parameters and carry no HF tensor: the record never names them.

=========================================  =============================================  =========
Megatron name (local spec)                  HF name(s)                                     TP split
=========================================  =============================================  =========
embedding.word_embeddings.weight            model.embed_tokens.weight                      VOCAB
decoder.layers.{i}.input_layernorm.weight   model.layers.{l}.input_layernorm.weight        REPLICATED
decoder.layers.{i}.self_attention.          model.layers.{l}.self_attn.{q,k,v}_proj.weight QKV
  linear_qkv.weight
decoder.layers.{i}.self_attention.          model.layers.{l}.self_attn.{q,k,v}_proj.bias   QKV
  linear_qkv.bias  (Qwen2 only)
decoder.layers.{i}.self_attention.          model.layers.{l}.self_attn.o_proj.weight       ROW
  linear_proj.weight
decoder.layers.{i}.pre_mlp_layernorm.weight model.layers.{l}.post_attention_layernorm.     REPLICATED
                                              weight
decoder.layers.{i}.mlp.linear_fc1.weight    model.layers.{l}.mlp.{gate,up}_proj.weight     GATE_UP
decoder.layers.{i}.mlp.linear_fc2.weight    model.layers.{l}.mlp.down_proj.weight          ROW
decoder.final_layernorm.weight              model.norm.weight                              REPLICATED
output_layer.weight        (policy)         lm_head.weight (untied) /                      VOCAB
                                              model.embed_tokens.weight (tied, see below)
output_layer.weight        (critic)         score.weight                                   REPLICATED
=========================================  =============================================  =========

Under the TE spec (``layer_spec="te"``) two rows differ, everything else is as above:

===========================================  ===========================================
local spec                                   TE spec
===========================================  ===========================================
decoder.layers.{i}.input_layernorm.weight    decoder.layers.{i}.self_attention.linear_qkv.
                                               layer_norm_weight
decoder.layers.{i}.pre_mlp_layernorm.weight  decoder.layers.{i}.mlp.linear_fc1.
                                               layer_norm_weight
===========================================  ===========================================

Qwen3 (``qk_layernorm``) adds two rows per layer, the same under both specs; Qwen3-MoE
replaces the MLP rows by a router and the routed experts (no shared expert). Layer l holds
global experts e; a rank of EP rank r with local = num_experts / EP experts holds
e = r * local + j as its local expert j (megatron's ``local_expert_indices_offset``); expert
tensors split over expert TP (``etp``, default TP) as a dense MLP's do over TP:

===================================================  =====================================  ========
Megatron name                                        HF name(s)                             split
===================================================  =====================================  ========
decoder.layers.{i}.self_attention.q_layernorm.weight model.layers.{l}.self_attn.q_norm.weight REPLICATED
decoder.layers.{i}.self_attention.k_layernorm.weight model.layers.{l}.self_attn.k_norm.weight REPLICATED
decoder.layers.{i}.mlp.router.weight                 model.layers.{l}.mlp.gate.weight       REPLICATED
decoder.layers.{i}.mlp.experts.local_experts.{j}.    model.layers.{l}.mlp.experts.{e}.      GATE_UP
  linear_fc1.weight    (SequentialMLP)                 {gate,up}_proj.weight                 (etp)
decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}  (same)                                 GATE_UP
                       (TEGroupedMLP, TE grouped GEMM)                                      (etp)
decoder.layers.{i}.mlp.experts.local_experts.{j}.    model.layers.{l}.mlp.experts.{e}.      ROW
  linear_fc2.weight    (SequentialMLP)                 down_proj.weight                     (etp)
decoder.layers.{i}.mlp.experts.linear_fc2.weight{j}  (same)                                 ROW (etp)
                       (TEGroupedMLP)
===================================================  =====================================  ========

An MoE layer keeps ``pre_mlp_layernorm.weight`` under the TE spec too (megatron's MoE spec
does not fuse it: ``pre_mlp_layernorm=TENorm``); only ``input_layernorm`` fuses into
``linear_qkv``. Which expert scheme a model has is ``ModelRecord.grouped_experts`` (TE spec with
``moe_grouped_gemm``); the local spec is always SequentialMLP. Shapes (E experts, fe
``moe_intermediate_size``): q_norm/k_norm [d]; gate [E, h]; per expert gate_proj/up_proj
[fe, h] -> linear_fc1 [2*fe / etp, h], down_proj [h, fe] -> linear_fc2 [h, fe / etp].

Distributed checkpoints do not see the difference: the local spec maps its norms' keys to the
TE names (``sharded_state_dict_keys_map`` in megatron's ``get_gpt_layer_local_spec``), so
checkpoint keys agree between the specs except for ``_extra_state`` (``checkpoint/model.py``).
An MoE layer's pre-MLP norm keeps ``pre_mlp_layernorm.weight`` under both: megatron-core 0.16.1's
local spec would map it to ``mlp.linear_fc1.layer_norm_weight`` whatever the MLP, and
``provider.local_spec`` drops that entry for MoE layers (``provider.moe_keys_map``). The
experts' keys agree: SequentialMLP and TEGroupedMLP both save ``mlp.experts.experts.*`` with a
global-expert axis (their ``sharded_state_dict``).

Shapes (h hidden, nh/ng query/KV heads, d head_dim, f intermediate, V vocab, t TP; Vp is V
rounded up to a multiple of make_vocab_size_divisible_by * t), HF -> one TP rank's shard:
q_proj [nh*d, h], k_proj/v_proj [ng*d, h] -> linear_qkv [(nh + 2*ng)*d / t, h] (biases
likewise without h); o_proj [h, nh*d] -> linear_proj [h, nh*d / t]; gate_proj/up_proj [f, h]
-> linear_fc1 [2*f / t, h]; down_proj [h, f] -> linear_fc2 [h, f / t]; embed_tokens/lm_head
[V, h] -> [Vp / t, h]; norms [h]; score [1, h] -> output_layer [1, h].

Tied embeddings. With PP = 1 the model has no ``output_layer.weight`` (it reads the
embedding). With PP > 1 the last stage keeps a copy that Megatron keeps equal to the embedding:
HF -> Megatron fills it from ``model.embed_tokens.weight``; Megatron -> HF maps it to nothing
(the first stage exports the embedding). A tied checkpoint must not carry ``lm_head.weight``.

Critic. The trunk is the policy's; the output layer is a value head, ``output_layer.weight``
of shape [1, hidden], no bias, replicated across TP (the model provider swaps GPTModel's
vocab-parallel output layer for a plain linear of that shape). Exported, it is ``score.weight``
of ``{Qwen2,Llama}ForSequenceClassification`` with num_labels = 1: the layout of a reward
model, so a reward model's checkpoint seeds the critic directly.

MTP layers built in the model (``ModelRecord.mtp``; DeepSeek-V3's ``num_nextn_predict_layers``,
``models/mtp.py``). The last stage holds depth k (HF layer l = num_layers + k); its transformer
layer maps as decoder layer l does (attention, norms, router, experts):

===========================================  ============================================  ==========
Megatron name                                HF name                                       TP split
===========================================  ============================================  ==========
mtp.layers.{k}.enorm.weight                  model.layers.{l}.enorm.weight                 REPLICATED
mtp.layers.{k}.hnorm.weight                  model.layers.{l}.hnorm.weight                 REPLICATED
mtp.layers.{k}.eh_proj.weight                model.layers.{l}.eh_proj.weight [h, 2h]       COLUMN
mtp.layers.{k}.transformer_layer.{suffix}    model.layers.{l}.{self_attn,mlp,...}          as decoder
mtp.layers.{k}.final_layernorm.weight        model.layers.{l}.shared_head.norm.weight      REPLICATED
embedding.word_embeddings.weight (last       model.embed_tokens.weight (loaded; not        VOCAB
  stage, PP > 1: the MTP layers' copy)         exported: the first stage's is)
===========================================  ============================================  ==========

An HF checkpoint also holds ``model.layers.{l}.shared_head.head.weight`` and
``model.layers.{l}.embed_tokens.weight``, copies of ``lm_head`` and ``embed_tokens``: passed over
on the way in (megatron's MTP reads the shared output layer and embedding), written from the
trained ones on export (``weights/export.py``). The rollout stream leaves every MTP tensor out
(``stream_mtp=False``): vLLM's deepseek_v2 loads none.

TP. Megatron-core requires TP to divide num_attention_heads and ffn, and num_key_value_heads
to be a multiple or a divisor of TP. When TP > num_key_value_heads, the fused QKV tensor is
still split into equal row chunks, so one query group's [q; k; v] block spans TP /
num_key_value_heads ranks; megatron's attention all-gathers it and each rank keeps its heads.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vapo_megatron.models.config import Head, HFModelConfig, LayerSpecKind
from vapo_megatron.weights.mtp import is_mtp_tensor

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


class Split(enum.Enum):
    """How a Megatron tensor is laid out over the ranks of a TP group."""

    REPLICATED = "replicated"
    """Every rank holds the whole tensor (norms, the value head)."""
    ROW = "row"
    """Row-parallel linear: dim 1 (the input features) in TP equal chunks."""
    COLUMN = "column"
    """Column-parallel linear: dim 0 (the output features) in TP equal chunks (MLA's
    projections; HF's per-head row order is megatron's)."""
    VOCAB = "vocab"
    """Vocab-parallel: zero rows pad dim 0 to the padded vocabulary, then TP equal chunks."""
    QKV = "qkv"
    """q, k, v fused per query group g as [q heads of g; k_g; v_g], then TP equal row chunks."""
    GATE_UP = "gate_up"
    """SwiGLU fc1: rank r holds [gate_r; up_r], gate and up each in TP equal row chunks."""


@dataclass(frozen=True)
class TensorMap:
    """One Megatron tensor of a model chunk and the HF tensors it is made of."""

    megatron_name: str
    """Name in the chunk's state dict (local layer numbering)."""
    hf_names: tuple[str, ...]
    """HF tensors, in fusion order: (q, k, v), (gate, up), or a single one."""
    split: Split
    """Layout over the TP ranks."""
    tied_copy: bool = False
    """The last stage's copy of a tied embedding (PP > 1): Megatron -> HF maps it to nothing."""
    expert: int | None = None
    """Global index of the routed expert this tensor belongs to (held by one EP rank, split
    over expert TP instead of TP); None for every other tensor."""
    mtp: bool = False
    """A tensor of the multi-token-prediction layers built in the model (``ModelRecord.mtp``)."""


@dataclass(frozen=True)
class ModelChunk:
    """The part of the model one pipeline stage (or one virtual stage) holds."""

    layers: range
    """Global (0-based) indices of its decoder layers; local layer i is global layers[i]."""
    has_embedding: bool
    """Holds the word embedding (first stage)."""
    has_output: bool
    """Holds the final norm and the output layer (last stage)."""
    ep_rank: int = 0
    """This rank's index in its expert-parallel group: it holds routed experts
    ``ep_rank * local + j`` for j in [0, local = num_experts / ep_size) (megatron's
    ``local_expert_indices_offset``). 0 for dense models."""
    ep_size: int = 1
    """Expert-parallel size (1 for dense models)."""

    @classmethod
    def whole(cls, num_layers: int) -> ModelChunk:
        """The whole model (no pipeline or expert parallelism)."""
        return cls(layers=range(num_layers), has_embedding=True, has_output=True)

    def global_expert(self, local_index: int, num_experts: int) -> int:
        """The global index of local expert ``local_index`` of this EP rank."""
        return self.ep_rank * (num_experts // self.ep_size) + local_index

    @classmethod
    def for_stage(
        cls,
        config: TransformerConfig,
        pp_rank: int,
        vp_stage: int | None = None,
        *,
        ep_rank: int = 0,
    ) -> ModelChunk:
        """The chunk GPTModel builds at this pipeline rank and virtual stage (and EP rank: the
        expert-parallel size is ``config.expert_model_parallel_size``).

        Delegates to megatron-core's own layer placement, so uneven pipelines
        (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``,
        ``account_for_embedding/loss_in_pipeline_split``) and interleaving are covered.
        """
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        if config.pipeline_model_parallel_layout is not None:
            raise ValueError(
                "pipeline_model_parallel_layout is not supported; use "
                "num_layers_in_first/last_pipeline_stage for an uneven split"
            )
        pp_size = config.pipeline_model_parallel_size
        vp_size = config.virtual_pipeline_model_parallel_size
        custom_split = (
            config.num_layers_in_first_pipeline_stage is not None
            or config.num_layers_in_last_pipeline_stage is not None
            or config.account_for_embedding_in_pipeline_split
            or config.account_for_loss_in_pipeline_split
        )
        if not custom_split and config.num_layers % (pp_size * (vp_size or 1)) != 0:
            raise ValueError(
                f"num_layers={config.num_layers} does not split evenly over PP={pp_size} x "
                f"VPP={vp_size or 1}; choose sizes that divide it or set "
                "num_layers_in_first/last_pipeline_stage for an uneven split"
            )
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        first_virtual = vp_stage is None or vp_stage == 0
        last_virtual = vp_stage is None or vp_stage == (vp_size or 1) - 1
        return cls(
            layers=range(offset, offset + count),
            has_embedding=pp_rank == 0 and first_virtual,
            has_output=pp_rank == pp_size - 1 and last_virtual,
            ep_rank=ep_rank,
            ep_size=config.expert_model_parallel_size,
        )


# Per decoder layer: (Megatron suffix under the local spec, under the TE spec, HF suffixes,
# split). The QKV bias is added for Qwen2.
_LAYER_MAPS: tuple[tuple[str, str, tuple[str, ...], Split], ...] = (
    (
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
        ("input_layernorm.weight",),
        Split.REPLICATED,
    ),
    (
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        Split.QKV,
    ),
    (
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.weight",
        ("self_attn.o_proj.weight",),
        Split.ROW,
    ),
    (
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
        ("post_attention_layernorm.weight",),
        Split.REPLICATED,
    ),
    (
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1.weight",
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        Split.GATE_UP,
    ),
    (
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2.weight",
        ("mlp.down_proj.weight",),
        Split.ROW,
    ),
)
_QKV_BIAS_MAP = (
    "self_attention.linear_qkv.bias",
    "self_attention.linear_qkv.bias",
    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    Split.QKV,
)
# Qwen3's per-head query/key RMSNorms (megatron ``qk_layernorm``), under both specs.
_QK_NORM_MAPS = (
    (
        "self_attention.q_layernorm.weight",
        "self_attention.q_layernorm.weight",
        ("self_attn.q_norm.weight",),
        Split.REPLICATED,
    ),
    (
        "self_attention.k_layernorm.weight",
        "self_attention.k_layernorm.weight",
        ("self_attn.k_norm.weight",),
        Split.REPLICATED,
    ),
)
# An MoE layer's router (megatron ``TopKRouter.weight``, [num_experts, hidden]), replicated.
_ROUTER_MAP = ("mlp.router.weight", "mlp.router.weight", ("mlp.gate.weight",), Split.REPLICATED)
# An MoE layer under the TE spec keeps its own pre-MLP norm (megatron's MoE spec has
# ``fuse_pre_mlp_layernorm: False``: ``pre_mlp_layernorm=TENorm``): only input_layernorm fuses.
_MOE_PRE_MLP_NORM = (
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.weight",
    ("post_attention_layernorm.weight",),
    Split.REPLICATED,
)
# An MoE layer's expert-score bias (DeepSeek-V3/GLM-4.5, sigmoid routers): megatron's
# ``TopKRouter.expert_bias``, a persistent fp32 buffer (not a parameter), replicated.
_EXPERT_BIAS_MAP = (
    "mlp.router.expert_bias",
    "mlp.router.expert_bias",
    ("mlp.gate.e_score_correction_bias",),
    Split.REPLICATED,
)
# Shared experts (megatron ``SharedExpertMLP``, a dense SwiGLU split over TP, not expert TP).
_SHARED_EXPERT_MAPS = (
    (
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc1.weight",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        Split.GATE_UP,
    ),
    (
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.linear_fc2.weight",
        ("mlp.shared_experts.down_proj.weight",),
        Split.ROW,
    ),
)
_MLA = "self_attention."
# DeepSeek-V3's MLA (``MLASelfAttention``), as (local name, TE name, HF names, split under the
# local spec, split under TE). The local spec's down projections are column-parallel (their
# outputs gathered before the split into latent and RoPE key); TE's are replicated TELinear;
# TE fuses the q/kv norms into the up projections and keeps input_layernorm a module.
_MLA_MAPS: tuple[tuple[str, str, tuple[str, ...], Split, Split], ...] = (
    ("input_layernorm.weight", "input_layernorm.weight", ("input_layernorm.weight",),
     Split.REPLICATED, Split.REPLICATED),
    (f"{_MLA}linear_q_down_proj.weight", f"{_MLA}linear_q_down_proj.weight",
     ("self_attn.q_a_proj.weight",), Split.COLUMN, Split.REPLICATED),
    (f"{_MLA}q_layernorm.weight", f"{_MLA}linear_q_up_proj.layer_norm_weight",
     ("self_attn.q_a_layernorm.weight",), Split.REPLICATED, Split.REPLICATED),
    (f"{_MLA}linear_q_up_proj.weight", f"{_MLA}linear_q_up_proj.weight",
     ("self_attn.q_b_proj.weight",), Split.COLUMN, Split.COLUMN),
    (f"{_MLA}linear_kv_down_proj.weight", f"{_MLA}linear_kv_down_proj.weight",
     ("self_attn.kv_a_proj_with_mqa.weight",), Split.COLUMN, Split.REPLICATED),
    (f"{_MLA}kv_layernorm.weight", f"{_MLA}linear_kv_up_proj.layer_norm_weight",
     ("self_attn.kv_a_layernorm.weight",), Split.REPLICATED, Split.REPLICATED),
    (f"{_MLA}linear_kv_up_proj.weight", f"{_MLA}linear_kv_up_proj.weight",
     ("self_attn.kv_b_proj.weight",), Split.COLUMN, Split.COLUMN),
    (f"{_MLA}linear_proj.weight", f"{_MLA}linear_proj.weight", ("self_attn.o_proj.weight",),
     Split.ROW, Split.ROW),
)  # fmt: skip
# Without q_lora_rank (Moonlight) the query is one full projection, in place of rows 1-3.
_MLA_FULL_Q = (
    f"{_MLA}linear_q_proj.weight", f"{_MLA}linear_q_proj.weight", ("self_attn.q_proj.weight",),
    Split.COLUMN, Split.COLUMN,
)  # fmt: skip
_DENSE_MLP_SUFFIXES = frozenset(f"mlp.{name}_proj.weight" for name in ("gate", "up", "down"))
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MTP_SUFFIXES = frozenset(
    ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
     "shared_head.head.weight", "embed_tokens.weight")
)  # fmt: skip
"""The names only an MTP layer has (HF ``model.layers.{num_layers + k}.``): its norms and
projection, and its copies of the lm head and the embedding (passed over on the way in,
written from the trained ones on export: ``weights/export.py``)."""
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(.+)")


@dataclass(frozen=True)
class ModelRecord:
    """HF <-> Megatron mapping of one model (policy or critic)."""

    config: HFModelConfig
    """The model's architecture."""
    head: Head = "lm"
    """'lm': policy with lm_head; 'value': critic with a value head (``score.weight``)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP."""
    layer_spec: LayerSpecKind = "local"
    """Layer spec of the model the names refer to: 'local' (megatron-core's local spec) or 'te'
    (Transformer Engine's, norms fused into the next linear); ``provider.layer_spec_kind``
    tells it for a built spec."""
    grouped_experts: bool = False
    """The routed experts are Transformer Engine's grouped GEMM (``TEGroupedMLP``: the TE
    spec with ``moe_grouped_gemm``), one parameter per local expert j named
    ``mlp.experts.linear_fc1.weight{j}``; else megatron's ``SequentialMLP``
    (``mlp.experts.local_experts.{j}.linear_fc1.weight``, the local spec and TE without grouped
    GEMM). Only meaningful for MoE models."""
    mtp: bool = False
    """The model holds its ``mtp_num_layers`` multi-token-prediction layers on its last stage
    (``models/mtp.py``: a policy with ``policy.mtp.loss_weight`` > 0), named as in the MTP
    table below; False: HF -> Megatron passes them over (carried as files, ``weights/mtp.py``)."""
    stream_mtp: bool = True
    """With ``mtp``: Megatron -> HF gives the MTP layers' tensors (export, conversion); False
    for the rollout engine's weight sync (vLLM's deepseek_v2 loads no MTP layer)."""

    def __post_init__(self) -> None:
        if self.layer_spec not in ("local", "te"):
            raise ValueError(f"layer_spec must be 'local' or 'te', got {self.layer_spec!r}")
        if self.grouped_experts and self.layer_spec != "te":
            raise ValueError(
                "grouped_experts needs layer_spec='te': megatron's local spec with "
                "moe_grouped_gemm builds the legacy GroupedMLP (weight1/weight2), which this "
                "record does not map; build the local spec without moe_grouped_gemm"
            )

    # ----- names -----

    def exports(self, m: TensorMap) -> bool:
        """Whether Megatron -> HF gives ``m``'s HF tensors (not a tied copy, not an MTP tensor
        left out of the rollout stream)."""
        return not m.tied_copy and (not m.mtp or self.stream_mtp)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has an MoE MLP (DeepSeek-V3/GLM-4.5's first
        ``first_k_dense`` layers are dense)."""
        return self.config.is_moe and layer >= self.config.first_k_dense

    def tensor_maps(self, chunk: ModelChunk) -> dict[str, TensorMap]:
        """Every Megatron parameter of ``chunk`` (by local name, under this record's layer spec),
        in the record's fixed order: the embedding, each layer, the final norm, the output layer
        (the order the weight stream sends them in)."""
        return _tensor_maps(self, chunk)

    def hf_names(self, chunk: ModelChunk) -> list[str]:
        """The HF tensors ``hf_to_megatron_shards`` needs for ``chunk``."""
        return [name for m in self.tensor_maps(chunk).values() for name in m.hf_names]

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """Shape of an HF tensor of this model; ValueError for a name it does not have."""
        key, out_of_range = hf_name, False
        layer = _HF_LAYER.fullmatch(hf_name)
        if layer is not None:
            index = int(layer[1])
            mtp_layer = index >= self.config.num_layers
            key = f"model.layers.*.{layer[2]}"
            out_of_range = index >= self.config.num_layers + self.mtp_layers
            out_of_range |= layer[2] in _MTP_SUFFIXES and not mtp_layer
            expert = _HF_EXPERT.fullmatch(layer[2])
            if expert is not None:
                key = f"model.layers.*.mlp.experts.*.{expert[2]}"
                out_of_range |= int(expert[1]) >= self.config.num_experts
            if layer[2].startswith("mlp.") and not out_of_range:  # dense or MoE layer's names
                dense_name = layer[2] in _DENSE_MLP_SUFFIXES
                out_of_range = dense_name == self.is_moe_layer(index)
        shape = _hf_shapes(self).get(key)
        if shape is None or out_of_range:
            raise ValueError(
                f"unknown HF tensor {hf_name!r} for a {self.config.family} model with "
                f"{self.config.num_layers} layers (the first {self.config.first_k_dense} "
                f"dense), {self.config.num_experts} experts, head={self.head!r}, "
                f"tie_word_embeddings={self.config.tie_word_embeddings}"
            )
        return shape

    def ep_peers(self, m: TensorMap, chunk: ModelChunk) -> list[TensorMap]:
        """The maps of the same Megatron tensor on every rank of ``chunk``'s expert-parallel
        group, by EP rank: for an expert's tensor, the same local slot j holding global expert
        ``r * local + j`` on EP rank r; for any other tensor, ``[m] * ep_size``."""
        if m.expert is None:
            return [m] * chunk.ep_size
        return [
            self.tensor_maps(dataclasses.replace(chunk, ep_rank=r))[m.megatron_name]
            for r in range(chunk.ep_size)
        ]

    @property
    def mtp_layers(self) -> int:
        """MTP layers the model holds (0 unless ``mtp``)."""
        return self.config.mtp_num_layers if self.mtp else 0

    # ----- HF -> Megatron -----

    def hf_to_megatron_shards(
        self,
        hf_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        tp_rank: int,
        tp_size: int,
        chunk: ModelChunk,
        *,
        etp_rank: int | None = None,
        etp_size: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The state dict of one (TP rank, model chunk), from HF-named tensors.

        The routed experts of ``chunk`` (its EP rank's) are split over expert tensor
        parallelism: ``etp_rank`` of ``etp_size`` (None: the TP rank and size, megatron's
        default ``expert_tensor_parallel_size``).

        ``hf_tensors`` may be a dict or a stream of (name, tensor) pairs (e.g. read lazily from
        safetensors files); tensors of other stages are passed over, and each fused group is
        converted as soon as its last member arrives, so a converter holds at most one layer's
        partial group besides the result. Every returned tensor owns its storage. ValueError
        for an unknown name, a duplicate, a wrong shape or a missing tensor. The MTP layers'
        tensors (DeepSeek-V3's ``num_nextn_predict_layers``) are passed over unless the
        record's ``mtp`` (else carried as files, ``weights/mtp.py``); with it, their copies of
        the lm head and the embedding are (megatron shares the model's).
        """
        etp_rank = tp_rank if etp_rank is None else etp_rank
        etp_size = tp_size if etp_size is None else etp_size
        self._check_parallel(tp_rank, tp_size, chunk)
        self._check_expert_parallel(etp_rank, etp_size, chunk)
        maps = self.tensor_maps(chunk)
        wanted = {hf_name: m for m in maps.values() for hf_name in m.hf_names}
        items = hf_tensors.items() if isinstance(hf_tensors, Mapping) else hf_tensors
        pending: dict[str, dict[str, torch.Tensor]] = {}
        shards: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        for hf_name, tensor in items:
            if not self.mtp and is_mtp_tensor(self.config, hf_name):
                continue  # carried beside the model, frozen (weights/mtp.py)
            expected = self.hf_shape(hf_name)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"HF tensor {hf_name!r}: expected shape {expected}, got {tuple(tensor.shape)}"
                )
            if hf_name in seen:
                raise ValueError(f"HF tensor {hf_name!r} given twice")
            seen.add(hf_name)
            if hf_name not in wanted:
                continue  # another pipeline stage's tensor
            m = wanted[hf_name]
            parts = pending.setdefault(m.megatron_name, {})
            parts[hf_name] = tensor
            if len(parts) == len(m.hf_names):
                del pending[m.megatron_name]
                parts_in_order = [parts[name] for name in m.hf_names]
                rank, size = (tp_rank, tp_size) if m.expert is None else (etp_rank, etp_size)
                shards[m.megatron_name] = self._to_shard(m, parts_in_order, rank, size)
        missing = [name for name in wanted if name not in seen]
        if missing:
            raise ValueError(
                f"{len(missing)} HF tensor(s) missing for layers {chunk.layers} "
                f"(embedding={chunk.has_embedding}, output={chunk.has_output}): {missing[:8]}"
            )
        return {name: shards[name] for name in maps}

    def _to_shard(
        self, m: TensorMap, parts: list[torch.Tensor], tp_rank: int, tp_size: int
    ) -> torch.Tensor:
        if m.split is Split.REPLICATED:
            return parts[0]
        if m.split is Split.ROW:
            return _piece(parts[0], 1, tp_rank, tp_size)
        if m.split is Split.COLUMN:
            return _piece(parts[0], 0, tp_rank, tp_size)
        if m.split is Split.VOCAB:
            # Zero rows pad the vocabulary; padded logits are masked by the log-prob code.
            full = parts[0]
            rows = self._padded_vocab(tp_size) // tp_size
            shard = full.new_zeros(rows, *full.shape[1:])
            real = full[tp_rank * rows : (tp_rank + 1) * rows]
            shard[: real.shape[0]] = real
            return shard
        if m.split is Split.QKV:
            groups = self.config.num_key_value_heads
            per_group = [part.reshape(groups, -1, *part.shape[1:]) for part in parts]
            fused = torch.cat(per_group, dim=1).reshape(-1, *parts[0].shape[1:])
            return _piece(fused, 0, tp_rank, tp_size)
        gate, up = parts  # Split.GATE_UP
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])

    # ----- Megatron -> HF -----

    def megatron_to_hf(
        self, megatron_name: str, tp_shards: Sequence[torch.Tensor], chunk: ModelChunk
    ) -> list[tuple[str, torch.Tensor]]:
        """The full HF tensor(s) of one Megatron tensor, from its shards on every TP rank.

        ``megatron_name`` is local to ``chunk``; ``tp_shards[r]`` is TP rank r's shard (for a
        routed expert's tensor: expert-TP rank r's). Fused QKV comes back as q, k, v; fc1 as
        gate, up; vocabulary padding is dropped. The tied embedding copy of the last stage
        gives ``[]``. Every returned tensor owns its storage.
        """
        tp_size = len(tp_shards)
        self._check_parallel(0, 1, chunk)
        m = self.tensor_maps(chunk).get(megatron_name)
        if m is not None and m.expert is not None:
            self._check_expert_parallel(0, tp_size, chunk)
        else:
            self._check_parallel(0, tp_size, chunk)
        if m is None:
            raise ValueError(
                f"unknown Megatron tensor {megatron_name!r} for layers {chunk.layers} "
                f"(embedding={chunk.has_embedding}, output={chunk.has_output}) of a "
                f"{self.config.family} model, head={self.head!r}, layer_spec="
                f"{self.layer_spec!r}"
            )
        expected = self._shard_shape(m, tp_size)
        for rank, shard in enumerate(tp_shards):
            if tuple(shard.shape) != expected:
                raise ValueError(
                    f"Megatron tensor {megatron_name!r} on TP rank {rank}: expected shape "
                    f"{expected}, got {tuple(shard.shape)}"
                )
        if not self.exports(m):
            return []
        return list(zip(m.hf_names, self._from_shards(m, tp_shards), strict=True))

    def _from_shards(self, m: TensorMap, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if m.split is Split.REPLICATED:
            return [shards[0]]
        if m.split is Split.ROW:
            return [torch.cat(list(shards), dim=1)]
        if m.split is Split.COLUMN:
            return [torch.cat(list(shards))]
        if m.split is Split.VOCAB:
            vocab, rows = self.config.vocab_size, shards[0].shape[0]
            real = [shard[: max(0, vocab - rank * rows)] for rank, shard in enumerate(shards)]
            return [torch.cat(real)]
        if m.split is Split.QKV:
            cfg = self.config
            fused = torch.cat(list(shards)).reshape(
                cfg.num_key_value_heads, -1, *shards[0].shape[1:]
            )
            q_rows = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim
            q, k, v = fused.split([q_rows, cfg.head_dim, cfg.head_dim], dim=1)
            return [_owning(x.reshape(-1, *shards[0].shape[1:])) for x in (q, k, v)]
        halves = [shard.chunk(2) for shard in shards]  # Split.GATE_UP
        return [torch.cat([half[0] for half in halves]), torch.cat([half[1] for half in halves])]

    # ----- shapes and checks -----

    def _padded_vocab(self, tp_size: int) -> int:
        return self.config.padded_vocab_size(tp_size, self.make_vocab_size_divisible_by)

    def _shard_shape(self, m: TensorMap, tp_size: int) -> tuple[int, ...]:
        first, *rest = self.hf_shape(m.hf_names[0])
        if m.split is Split.REPLICATED:
            return (first, *rest)
        if m.split is Split.ROW:
            return (first, rest[0] // tp_size)
        if m.split is Split.VOCAB:
            return (self._padded_vocab(tp_size) // tp_size, *rest)
        rows = sum(self.hf_shape(name)[0] for name in m.hf_names)  # QKV, GATE_UP, COLUMN
        return (rows // tp_size, *rest)

    def _check_parallel(self, tp_rank: int, tp_size: int, chunk: ModelChunk) -> None:
        cfg = self.config
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} is not in [0, tp_size={tp_size})")
        heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv_rows = (heads + 2 * groups) * cfg.head_dim
        dense_mlp = not cfg.is_moe or cfg.first_k_dense > 0
        if cfg.mla is not None:  # column-split latent widths (the local spec's down projections)
            mla = cfg.mla
            widths = [mla.kv_lora_rank + mla.qk_rope_head_dim, mla.q_lora_rank or heads]
            if any(width % tp_size for width in widths):
                raise ValueError(
                    f"TP={tp_size} must divide q_lora_rank={mla.q_lora_rank} and kv_lora_rank + "
                    f"qk_rope_head_dim={widths[0]} (megatron's local MLA splits the down "
                    "projections over TP); choose another TP"
                )
            groups, qkv_rows = heads, 0
        shared = cfg.moe_intermediate_size * cfg.num_shared_experts
        if (
            heads % tp_size
            or (groups % tp_size and tp_size % groups)
            or qkv_rows % tp_size
            or (dense_mlp and cfg.intermediate_size % tp_size)
            or shared % tp_size
        ):
            raise ValueError(
                f"TP={tp_size} does not fit this model: megatron-core needs TP to divide "
                f"num_attention_heads={heads}, intermediate_size={cfg.intermediate_size}, the "
                f"shared experts' width={shared} and the fused QKV rows={qkv_rows}, and "
                f"num_key_value_heads={groups} to be a multiple or a divisor of TP; choose "
                "another TP"
            )
        if chunk.layers.step != 1 or chunk.layers.start < 0 or chunk.layers.stop > cfg.num_layers:
            raise ValueError(f"layers {chunk.layers} are not within the model's {cfg.num_layers}")
        if not 0 <= chunk.ep_rank < chunk.ep_size:
            raise ValueError(f"ep_rank={chunk.ep_rank} is not in [0, ep_size={chunk.ep_size})")
        if chunk.ep_size > 1 and not cfg.is_moe:
            raise ValueError(f"ep_size={chunk.ep_size} on a dense {cfg.family} model; use ep=1")
        if cfg.is_moe and cfg.num_experts % chunk.ep_size:
            raise ValueError(
                f"EP={chunk.ep_size} must divide num_experts={cfg.num_experts}; choose another EP"
            )

    def _check_expert_parallel(self, etp_rank: int, etp_size: int, chunk: ModelChunk) -> None:
        if not 0 <= etp_rank < etp_size:
            raise ValueError(f"etp_rank={etp_rank} is not in [0, etp_size={etp_size})")
        width = self.config.moe_intermediate_size
        if self.config.is_moe and width % etp_size:
            raise ValueError(
                f"expert TP={etp_size} must divide moe_intermediate_size={width}; choose "
                "another etp (expert tensor parallel size, default: tp)"
            )
        self._check_parallel(0, 1, chunk)


@functools.cache
def _tensor_maps(record: ModelRecord, chunk: ModelChunk) -> dict[str, TensorMap]:
    maps: list[TensorMap] = []
    if chunk.has_embedding:
        maps.append(
            TensorMap(
                "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Split.VOCAB
            )
        )
    for local, layer in enumerate(chunk.layers):
        moe = record.is_moe_layer(layer)
        for megatron_suffix, hf_suffixes, split in _layer_maps(record, moe):
            hf_names = tuple(f"model.layers.{layer}.{suffix}" for suffix in hf_suffixes)
            maps.append(TensorMap(f"decoder.layers.{local}.{megatron_suffix}", hf_names, split))
        if moe:
            maps.extend(_expert_maps(record, chunk, local, layer))
    if chunk.has_output:
        maps.append(
            TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), Split.REPLICATED)
        )
        if record.head == "value":
            maps.append(TensorMap("output_layer.weight", ("score.weight",), Split.REPLICATED))
        elif not record.config.tie_word_embeddings:
            maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), Split.VOCAB))
        elif not chunk.has_embedding:
            maps.append(
                TensorMap(
                    "output_layer.weight",
                    ("model.embed_tokens.weight",),
                    Split.VOCAB,
                    tied_copy=True,
                )
            )
        if record.mtp:
            maps.extend(_mtp_maps(record, chunk))
    return {m.megatron_name: m for m in maps}


def _mtp_maps(record: ModelRecord, chunk: ModelChunk) -> list[TensorMap]:
    """The MTP layers on the last stage: depth k is HF layer ``num_layers + k``; its
    transformer layer maps as a decoder layer; on a last stage without the embedding, the
    embedding's copy the MTP layers read (loaded from the embedding, never exported)."""
    maps = []
    if not chunk.has_embedding:
        maps.append(
            TensorMap(
                "embedding.word_embeddings.weight",
                ("model.embed_tokens.weight",),
                Split.VOCAB,
                tied_copy=True,
            )
        )
    for depth in range(record.config.mtp_num_layers):
        layer = record.config.num_layers + depth
        hf, mg = f"model.layers.{layer}", f"mtp.layers.{depth}"
        rows = [
            ("enorm.weight", ("enorm.weight",), Split.REPLICATED),
            ("hnorm.weight", ("hnorm.weight",), Split.REPLICATED),
            ("eh_proj.weight", ("eh_proj.weight",), Split.COLUMN),
        ]
        moe = record.is_moe_layer(layer)
        rows += [(f"transformer_layer.{m}", h, sp) for m, h, sp in _layer_maps(record, moe)]
        rows.append(("final_layernorm.weight", ("shared_head.norm.weight",), Split.REPLICATED))
        for megatron_suffix, hf_suffixes, split in rows:
            hf_names = tuple(f"{hf}.{suffix}" for suffix in hf_suffixes)
            maps.append(TensorMap(f"{mg}.{megatron_suffix}", hf_names, split, mtp=True))
        if moe:
            experts = _expert_maps(record, chunk, layer, layer, prefix=f"{mg}.transformer_layer")
            maps.extend(dataclasses.replace(m, mtp=True) for m in experts)
    return maps


@functools.cache
def _layer_maps(record: ModelRecord, moe: bool) -> tuple[tuple[str, tuple[str, ...], Split], ...]:
    """(Megatron suffix under the record's spec, HF suffixes, split) of one decoder layer,
    routed experts excepted: attention (GQA with its bias and q/k norms, or MLA), then the
    dense MLP or the MoE layer's pre-MLP norm, router, expert bias and shared experts."""
    cfg, te = record.config, record.layer_spec == "te"
    if moe:
        mlp = (_MOE_PRE_MLP_NORM,)
        extra = (_ROUTER_MAP,) + ((_EXPERT_BIAS_MAP,) if cfg.router_score == "sigmoid" else ())
        extra += _SHARED_EXPERT_MAPS if cfg.num_shared_experts else ()
    else:
        mlp, extra = _LAYER_MAPS[3:], ()
    if cfg.mla is not None:
        mla = _MLA_MAPS if cfg.mla.q_lora_rank is not None else (
            _MLA_MAPS[:1] + (_MLA_FULL_Q,) + _MLA_MAPS[4:]
        )  # fmt: skip
        rows = [(t if te else loc, hf, ts if te else ls) for loc, t, hf, ls, ts in mla]
        rest = mlp + extra
    else:  # the order of the Qwen/Llama records: attention, MLP, biases, norms, router
        rows = []
        rest = _LAYER_MAPS[:3] + mlp + ((_QKV_BIAS_MAP,) if cfg.qkv_bias else ())
        rest += (_QK_NORM_MAPS if cfg.qk_layernorm else ()) + extra
    rows += [(t if te else loc, hf, split) for loc, t, hf, split in rest]
    return tuple(rows)


def _expert_maps(
    record: ModelRecord, chunk: ModelChunk, local: int, layer: int, *, prefix: str = ""
) -> list[TensorMap]:
    """The routed experts of local layer ``local`` (global ``layer``) on ``chunk``'s EP rank:
    local expert j is global expert ``ep_rank * local_count + j``; per expert, fc1 (gate and
    up fused as in a dense MLP) then fc2. Names as megatron-core 0.16.1's ``SequentialMLP``
    (``local_experts.{j}`` modules) or ``TEGroupedMLP`` (TE ``GroupedLinear``'s ``weight{j}``)
    register them (``transformer/moe/experts.py``). ``prefix``: the Megatron layer's (default
    decoder layer ``local``'s)."""
    maps = []
    prefix = f"{prefix or f'decoder.layers.{local}'}.mlp.experts"
    for j in range(record.config.num_experts // chunk.ep_size):
        expert = chunk.global_expert(j, record.config.num_experts)
        hf = f"model.layers.{layer}.mlp.experts.{expert}"
        if record.grouped_experts:
            fc1, fc2 = f"{prefix}.linear_fc1.weight{j}", f"{prefix}.linear_fc2.weight{j}"
        else:
            fc1 = f"{prefix}.local_experts.{j}.linear_fc1.weight"
            fc2 = f"{prefix}.local_experts.{j}.linear_fc2.weight"
        gate_up = (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight")
        maps.append(TensorMap(fc1, gate_up, Split.GATE_UP, expert=expert))
        maps.append(TensorMap(fc2, (f"{hf}.down_proj.weight",), Split.ROW, expert=expert))
    return maps


@functools.cache
def _hf_shapes(record: ModelRecord) -> dict[str, tuple[int, ...]]:
    """Full HF shape by name, layers written as ``model.layers.*``."""
    cfg = record.config
    hidden, q_rows = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, hidden),
        "mlp.up_proj.weight": (cfg.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, cfg.intermediate_size),
    }
    if cfg.qkv_bias:
        layer.update(
            {
                "self_attn.q_proj.bias": (q_rows,),
                "self_attn.k_proj.bias": (kv_rows,),
                "self_attn.v_proj.bias": (kv_rows,),
            }
        )
    if cfg.qk_layernorm and cfg.mla is None:
        layer.update({"self_attn.q_norm.weight": (cfg.head_dim,)})
        layer.update({"self_attn.k_norm.weight": (cfg.head_dim,)})
    if cfg.is_moe:  # experts written as mlp.experts.*; hf_shape checks the index and layer
        layer.update(_moe_shapes(cfg))
    if cfg.mla is not None:
        for name in ("q", "k", "v", "o"):
            del layer[f"self_attn.{name}_proj.weight"]
        layer.update(_mla_shapes(cfg))
    if record.mtp:  # the MTP layers' own tensors (_MTP_SUFFIXES); hf_shape checks the layer
        layer.update(
            dict.fromkeys(("enorm.weight", "hnorm.weight", "shared_head.norm.weight"), (hidden,))
        )
        layer["eh_proj.weight"] = (hidden, 2 * hidden)
        layer["shared_head.head.weight"] = layer["embed_tokens.weight"] = (cfg.vocab_size, hidden)
    shapes = {f"model.layers.*.{name}": shape for name, shape in layer.items()}
    shapes["model.embed_tokens.weight"] = (cfg.vocab_size, hidden)
    shapes["model.norm.weight"] = (hidden,)
    if record.head == "value":
        shapes["score.weight"] = (1, hidden)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def _moe_shapes(cfg: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """An MoE layer's HF shapes (router, its bias, routed and shared experts)."""
    hidden, width = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {
        "mlp.gate.weight": (cfg.num_experts, hidden),
        "mlp.experts.*.gate_proj.weight": (width, hidden),
        "mlp.experts.*.up_proj.weight": (width, hidden),
        "mlp.experts.*.down_proj.weight": (hidden, width),
    }
    if cfg.router_score == "sigmoid":
        shapes["mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
    if cfg.num_shared_experts:
        shared = width * cfg.num_shared_experts
        shapes["mlp.shared_experts.gate_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_experts.up_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_experts.down_proj.weight"] = (hidden, shared)
    return shapes


def _mla_shapes(cfg: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's attention shapes (transformers' ``DeepseekV3Attention``)."""
    mla, hidden, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    shapes = {
        "self_attn.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
        "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (
            heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            mla.kv_lora_rank,
        ),
        "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank is None:
        shapes["self_attn.q_proj.weight"] = (heads * mla.q_head_dim, hidden)
    else:
        shapes["self_attn.q_a_proj.weight"] = (mla.q_lora_rank, hidden)
        shapes["self_attn.q_a_layernorm.weight"] = (mla.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (heads * mla.q_head_dim, mla.q_lora_rank)
    return shapes


def _piece(tensor: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank's equal chunk of ``tensor`` along ``dim``, in its own storage."""
    return _owning(tensor.chunk(tp_size, dim=dim)[tp_rank])


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it is contiguous and spans its whole storage, else a contiguous copy.

    A view into a larger tensor would keep that tensor alive (a converter's memory) and
    cannot be written by safetensors alongside its siblings.
    """
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if whole and tensor.is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
