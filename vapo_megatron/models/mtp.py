"""DeepSeek-V3's multi-token-prediction (MTP) layers built in megatron and trained with a loss
of their own (``policy.mtp.loss_weight`` > 0; at 0 they are carried frozen beside the model as
files, ``weights/mtp.py``).

Depth k (0-based) of ``mtp_num_layers`` takes the main model's last hidden state h_t (after its
final norm) and the embedding of token t + 1 + k, and predicts token t + 2 + k::

    x = eh_proj(cat[enorm(emb(token[t + 1 + k])), hnorm(h^(k)_t)])   # h^(0) = the main model's
    h^(k+1) = final_layernorm(transformer_layer(x))                   # the MTP layer's output
    logits^(k) = output_layer(h^(k+1))                                # the shared LM head

(megatron-core 0.16.1 ``multi_token_prediction.py``: the embedding first in the concatenation,
line 736). HF names them ``model.layers.{L + k}.enorm/hnorm/eh_proj/self_attn/mlp/
shared_head.norm`` (``weights/record.py``).

What this module changes in megatron's own path, and why:

- megatron's ``GPTModel.forward(labels=None)`` raises with MTP (``labels.clone()``, gpt_model.py
  612), and with labels it returns a loss, not logits, with the MTP loss pushed into the main
  gradient by ``MTPLossAutoScaler``. :class:`MTPGPTModel` returns the main logits as a plain
  GPTModel does, and with ``mtp_heads=True`` also each depth's logits, so the RL loss
  (``step/losses.py``) adds the MTP loss itself, with its own weight and normaliser.
- The MTP loss trains the MTP layers only: the trunk's hidden state, the embedding lookup and
  the output layer's weight enter the MTP heads detached. So the policy gradient is the RL
  objective's alone (main-model logits and updates at any loss weight equal those of the
  frozen path), which is verl's recommended choice (``detach_encoder=True``: docs/advance/
  mtp.md reports that an MTP loss reaching the whole model visibly changes RL training, a
  detached one does not); megatron's pretraining path (and DeepSeek-V3's) lets it reach the
  trunk.
- megatron-core 0.16.1 builds the MTP block, its layer's eh_proj and transformer layer on
  ``parallel_state``'s groups (``MultiTokenPredictionBlock`` gets no ``pg_collection`` from
  GPTModel; ``get_mtp_num_layers_to_build`` and ``get_transformer_layer_offset`` read the
  global pipeline rank). Here every part takes the model's own groups (:class:`MTPBlock`,
  :class:`MTPLayer`), so the policy can run on a layout of its own.
- Packed rows carry no position ids; megatron's MTP rolls them (with RoPE nothing reads them),
  so the model hands it zeros.

The MTP layer's router has layer number ``num_layers + k + 1``: routing replay records and
replays the decoder's routers only, so the MTP layers route from their own scores in every
pass (``models/router_replay.py`` lists decoder routers only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import gpt_model
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    _get_mtp_block_submodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_viewless_tensor

from vapo_megatron.models.config import LayerSpecKind
from vapo_megatron.models.norm import RMSNorm

MTPOutput = tuple[torch.Tensor, tuple[torch.Tensor, ...]]
"""(main logits [b, s, V/tp], each depth's logits [b, s, V/tp]): what :class:`MTPGPTModel`
returns with ``mtp_heads=True`` (a plain tuple: megatron's Float16Module converts tuples)."""


def mtp_block_spec(
    layer_spec: ModuleSpec, kind: LayerSpecKind, num_layers: int
) -> MultiTokenPredictionBlockSubmodules:
    """The MTP block of ``num_layers`` depths, each around ``layer_spec`` (the decoder's last
    layer's: an MoE layer for DeepSeek-V3). Local spec: the project's RMSNorm and megatron's
    ColumnParallelLinear; TE: TE's norm and column-parallel linear (megatron's TE backend)."""
    if kind == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
        norm, linear = backend.layer_norm(rms_norm=True), backend.column_parallel_linear()
    else:
        norm, linear = RMSNorm, ColumnParallelLinear
    layer = ModuleSpec(
        module=MTPLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=linear, transformer_layer=layer_spec, layer_norm=norm
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers)


class MTPLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer on the model's own process groups (its forward unchanged)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MultiTokenPredictionLayerSubmodules,
        layer_number: int = 1,
        vp_stage: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        MegatronModule.__init__(self, config=config)  # megatron's __init__ reads parallel_state
        self.sequence_parallel = config.sequence_parallel
        self.submodules = submodules
        self.layer_number = layer_number  # the depth, from 1 (no custom pipeline layout)
        self.vp_stage = vp_stage
        self.cp_group, self.tp_group = pg_collection.cp, pg_collection.tp
        norm = functools.partial(
            build_module, config=config, hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
        )  # fmt: skip
        self.enorm, self.hnorm = norm(submodules.enorm), norm(submodules.hnorm)
        self.eh_proj = build_module(
            submodules.eh_proj, 2 * config.hidden_size, config.hidden_size, config=config,
            init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=False, is_expert=False, tp_group=pg_collection.tp,
        )  # fmt: skip
        # The transformer layer adds its stage's offset: its layer number comes out as
        # num_layers + depth, as in megatron (the router's layer_number).
        offset = get_transformer_layer_offset(config, vp_stage, pg_collection.pp.rank())
        self.transformer_layer = build_module(
            submodules.transformer_layer, config=config, vp_stage=vp_stage,
            layer_number=config.num_layers + layer_number - offset, pg_collection=pg_collection,
        )  # fmt: skip
        self.final_layernorm = norm(submodules.layer_norm)
        self.offload_context = nullcontext()

    def _concat_embeddings(self, hidden_states: torch.Tensor, decoder_input: torch.Tensor):
        """megatron's, with the model's TP group for the gather and the SP scatter."""
        decoder_input = make_viewless_tensor(
            inp=self.enorm(decoder_input), requires_grad=True, keep_graph=True
        )
        hidden_states = make_viewless_tensor(
            inp=self.hnorm(hidden_states), requires_grad=True, keep_graph=True
        )
        hidden_states, _ = self.eh_proj(torch.cat((decoder_input, hidden_states), -1))
        hidden_states = gather_from_tensor_model_parallel_region(hidden_states, self.tp_group)
        if self.sequence_parallel:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, self.tp_group)
        return hidden_states

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        """megatron's full (uniform) recompute of the layer, with the non-tensor arguments
        bound outside the checkpoint: megatron-core 0.16.1 hands every keyword to it
        positionally, and its ``save_for_backward`` refuses a ``PackedSeqParams`` (every
        packed micro-batch)."""
        if self.config.recompute_method != "uniform" or self.config.fp8 or args:
            return super()._checkpointed_forward(forward_func, *args, **kwargs)
        names = [k for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)]
        bound = {k: v for k, v in kwargs.items() if k not in names}

        def run(*tensors):
            return forward_func(**bound, **dict(zip(names, tensors, strict=True)))

        saved = self.config.distribute_saved_activations
        return tensor_parallel.checkpoint(run, saved, *(kwargs[k] for k in names))


class MTPBlock(MultiTokenPredictionBlock):
    """megatron's MTP block built on ``pg_collection`` (megatron's reads parallel_state)."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: MultiTokenPredictionBlockSubmodules,
        vp_stage: int | None = None,
        *,
        pg_collection: ProcessGroupCollection,
    ):
        MegatronModule.__init__(self, config=config)
        self.submodules = _get_mtp_block_submodules(config, spec)
        self.mtp_loss_scaling_factor = config.mtp_loss_scaling_factor
        self.vp_stage = vp_stage
        self._build_layers(pg_collection)
        # MegatronModule.sharded_state_dict reads parallel_state's TP group without one.
        self.cp_group, self.tp_group = pg_collection.cp, pg_collection.tp


@contextlib.contextmanager
def _blocks_on(pg_collection: ProcessGroupCollection) -> Iterator[None]:
    """GPTModel builds ``MultiTokenPredictionBlock(config, spec, vp_stage)`` by that module-level
    name with no groups: for the duration of one build, the name makes an :class:`MTPBlock`
    on ``pg_collection``."""
    saved = gpt_model.MultiTokenPredictionBlock
    gpt_model.MultiTokenPredictionBlock = functools.partial(MTPBlock, pg_collection=pg_collection)
    try:
        yield
    finally:
        gpt_model.MultiTokenPredictionBlock = saved


class MTPGPTModel(GPTModel):
    """GPTModel whose last stage holds the MTP layers: forward gives the main logits
    [b, s, V/tp] as GPTModel's does (labels are refused), and with ``mtp_heads=True`` the
    :data:`MTPOutput` (main logits, each depth's logits), the MTP heads on detached inputs."""

    def __init__(self, *args, pg_collection: ProcessGroupCollection, **kwargs):
        with _blocks_on(pg_collection):
            super().__init__(*args, pg_collection=pg_collection, **kwargs)
        self._mtp_heads = False

    def forward(self, *args, mtp_heads: bool = False, **kwargs):
        """GPTModel's forward; ``mtp_heads``: also return each MTP depth's logits."""
        if kwargs.get("labels") is not None:
            raise ValueError(
                "MTPGPTModel returns logits: compute the loss from them (step/losses.py), "
                "labels would add megatron's MTP loss to the main gradient"
            )
        self._mtp_heads = mtp_heads
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._mtp_heads = False

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """Main logits (and the MTP heads' when asked) on the last stage; megatron's
        ``_postprocess`` would run the MTP block unasked and need labels."""
        if not self.post_process:
            return hidden_states
        if kwargs.get("inference_context") is not None:
            raise ValueError("MTPGPTModel has no inference path; use the rollout engine")
        gather = kwargs.get("runtime_gather_output")
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else None
        )
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=gather)
        logits = logits.transpose(0, 1).contiguous()
        if not self._mtp_heads:
            return logits
        return logits, self._heads(hidden_states, input_ids, position_ids, weight, **kwargs)

    def _heads(
        self, hidden_states, input_ids, position_ids, weight, **kwargs
    ) -> tuple[torch.Tensor, ...]:
        """Each depth's logits [b, s, V/tp] from the MTP block, on the trunk's detached
        hidden states, embeddings and output weight (the MTP loss trains the MTP layers only)."""
        if position_ids is None:  # RoPE reads none; megatron's MTP rolls them all the same
            position_ids = torch.zeros_like(input_ids)
        # Detached, yet a leaf that asks for its gradient: under full recompute megatron wraps
        # the MTP layer in a checkpoint function whose output needs an input that requires
        # grad, else no gradient reaches the MTP layer (the embedding's comes detached too).
        trunk = hidden_states.detach().requires_grad_(torch.is_grad_enabled())
        packed = kwargs.get("packed_seq_params")
        if packed is not None:
            # megatron's roll keeps to [cu_seqlens_q[i], cu_seqlens_q[i + 1]), real-token
            # counts, but a sequence lies at cu_seqlens_q_padded[i] in the row: roll (and
            # attend) over the padded slots; causal attention keeps padding after the real
            # tokens out of their outputs.
            padded = packed.cu_seqlens_q_padded
            packed = dataclasses.replace(packed, cu_seqlens_q=padded, cu_seqlens_kv=padded)
        hidden = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=trunk,
            attention_mask=kwargs.get("attention_mask"),
            rotary_pos_emb=kwargs.get("rotary_pos_emb"),
            rotary_pos_cos=kwargs.get("rotary_pos_cos"),
            rotary_pos_sin=kwargs.get("rotary_pos_sin"),
            packed_seq_params=packed,
            sequence_len_offset=kwargs.get("sequence_len_offset"),
            embedding=self._detached_embedding,
            **(kwargs.get("extra_block_kwargs") or {}),
        )
        depths = torch.chunk(hidden, 1 + self.config.mtp_num_layers, dim=0)[1:]
        head = (weight if weight is not None else self.output_layer.weight).detach()
        gather = kwargs.get("runtime_gather_output")
        return tuple(
            self.output_layer(h, weight=head, runtime_gather_output=gather)[0]
            .transpose(0, 1)
            .contiguous()
            for h in depths
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """GPTModel's, with ``metadata``'s dp_cp_group filled in: GPTModel reads it for the
        last stage's copy of the embedding (MTP without the first stage) from the dict it was
        given, None when the caller gave none (the converter's meta model)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def _detached_embedding(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        with torch.no_grad():
            return self.embedding(input_ids=input_ids, position_ids=position_ids)


def split_output(output: torch.Tensor | MTPOutput) -> tuple[torch.Tensor, Sequence[torch.Tensor]]:
    """(main logits, MTP logits per depth) of a model's output (no depths: a plain tensor)."""
    if isinstance(output, tuple):
        return output[0], output[1]
    return output, ()


def mtp_targets(
    labels: torch.Tensor, mask: torch.Tensor, depth: int, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and mask [b, s] of MTP depth ``depth`` (0-based): at position t, the main head's
    label of position t + 1 + depth (token t + 2 + depth) and its mask, within t's own sequence
    (``cu_seqlens``: packed rows' sequence starts [n + 1]; None: each row is one sequence);
    0 and False where that position lies past the sequence's end. ``labels``/``mask``: the
    main head's (``MicroBatch.labels``, ``response_mask``), label-aligned."""
    shift = depth + 1
    rolled_labels = torch.zeros_like(labels)
    rolled_mask = torch.zeros_like(mask)
    bounds = [0, labels.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end - start > shift:
            rolled_labels[:, start : end - shift] = labels[:, start + shift : end]
            rolled_mask[:, start : end - shift] = mask[:, start + shift : end]
    return rolled_labels, rolled_mask
