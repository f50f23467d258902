"""Build the policy (LM head) and the critic (value head) as megatron-core GPTModels.

One HF config and one layout give the model chunks of this rank: one chunk, or one per
virtual pipeline stage. Policy and critic take independent layouts. Layer specs: Transformer
Engine's on a GPU when it is installed, else megatron-core's local spec with the project's core
attention (context parallelism and packed sequences without Transformer Engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from vapo_megatron.models.config import Head, HFModelConfig
from vapo_megatron.models.gpu_settings import ResolvedGpuSettings
from vapo_megatron.models.norm import RMSNorm
from vapo_megatron.models.value_head import ValueHead
from vapo_megatron.parallel.model_groups import layout_sizes


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """How one model (policy or critic) is split; data parallelism takes the remaining ranks."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None: off."""
    sequence_parallel: bool = False
    """Shard norms' and dropouts' activations along the sequence across TP (needs tp > 1)."""

    def check(self, hf: HFModelConfig) -> None:
        """ValueError naming the value and the fix for a layout the model cannot take."""
        if min(self.tp, self.pp, self.cp) < 1 or (self.vpp is not None and self.vpp < 1):
            raise ValueError(f"parallel sizes must be >= 1, got {self}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1; set sequence_parallel=false")
        if self.vpp is not None and self.pp == 1:
            raise ValueError("virtual pipeline stages (vpp) need pp > 1; set vpp=null")
        kv = hf.num_key_value_heads
        if hf.num_attention_heads % self.tp or (kv % self.tp and self.tp % kv):
            raise ValueError(
                f"tp={self.tp} must divide num_attention_heads={hf.num_attention_heads}, and "
                f"num_key_value_heads={kv} must be a multiple or a divisor of it; pick another tp"
            )
        stages = self.pp * (self.vpp or 1)
        if hf.num_layers % stages:
            raise ValueError(
                f"pp * vpp = {stages} must divide num_layers={hf.num_layers}; change pp or vpp"
            )


def check_layout_pair(policy: ModelLayout, critic: ModelLayout, world_size: int) -> None:
    """ValueError unless both layouts fit ``world_size`` ranks (each model spans all of them).

    Each model runs on its own process groups (``parallel.model_groups``), so in
    megatron-core 0.16.1 every pair of layouts whose tp * pp * cp divides the world is
    supported: any TP, PP (with or without vpp), CP, sequence parallelism and DP for the
    policy, independently of the critic's. None is refused for the pairing itself: the
    process-global state both models share (the RNG tracker, the scratch buffer) is listed,
    with why it is harmless, in ``parallel/model_groups.py``. Tested in one 4-rank job
    (``tests/distributed/test_mixed_layouts.py``): policy TP2 + SP / critic TP1 x DP4
    (distributed optimizer); policy DP4 / critic PP2 x DP2; policy TP2 x PP2 (vpp 2) / critic
    CP2 x DP2.
    """
    for name, layout in (("policy", policy), ("critic", critic)):
        try:
            layout_sizes(tp=layout.tp, pp=layout.pp, cp=layout.cp, world_size=world_size)
        except ValueError as err:
            raise ValueError(f"{name} layout: {err}") from None


def transformer_config(
    hf: HFModelConfig,
    layout: ModelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    gpu: ResolvedGpuSettings | None = None,
) -> TransformerConfig:
    """The TransformerConfig of ``hf`` under ``layout`` (fp32 or bf16 parameters).

    ``gpu``: the fusions :func:`gpu_settings.resolve` chose; None leaves megatron-core's
    defaults (every fusion off), as on CPU.
    """
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype must be float32 or bfloat16, got {params_dtype}")
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    return TransformerConfig(
        **hf.transformer_config_kwargs(),
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
        **(gpu.transformer_config_kwargs() if gpu is not None else {}),
    )


def default_layer_spec() -> ModuleSpec:
    """Transformer Engine's layer spec on a GPU with TE installed, else the local spec with
    the project's core attention and RMSNorm (see :func:`_block_spec`)."""
    if torch.cuda.is_available():
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    from vapo_megatron.models.layer_spec import local_layer_spec

    spec = local_layer_spec()
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    return spec


def _block_spec(
    config: TransformerConfig, layer_spec: ModuleSpec, vp_stage: int | None, pp_rank: int
):
    """Layer spec -> block spec. With our RMSNorm in the layers, the final norm is ours too
    (megatron's default final norm is the torch fallback, which refuses sequence parallelism)."""
    if layer_spec.submodules.input_layernorm is not RMSNorm:
        return layer_spec
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * count, layer_norm=RMSNorm)


def build_model(
    hf: HFModelConfig,
    config: TransformerConfig,
    *,
    head: Head,
    pg_collection: ProcessGroupCollection | None = None,
    layer_spec: ModuleSpec | None = None,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage) of the policy or critic.

    ``pg_collection``: this model's groups (``ModelGroups.pg_collection``), with sizes equal to
    the config's; None reads ``parallel_state``'s (which must then hold the config's layout).
    For ``head='value'`` the last stage's output layer is a :class:`ValueHead` and the model
    returns values [b, s, 1].
    """
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    sizes = {
        "tp": (pg_collection.tp.size(), config.tensor_model_parallel_size),
        "pp": (pg_collection.pp.size(), config.pipeline_model_parallel_size),
        "cp": (pg_collection.cp.size(), config.context_parallel_size),
    }
    if any(have != want for have, want in sizes.values()):
        raise ValueError(
            f"process groups (size, config size) {sizes} disagree: build the groups with the "
            f"layout the config was made from"
        )
    if layer_spec is None:
        layer_spec = default_layer_spec()
    tp = config.tensor_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        pre = pp_rank == 0 and vp_stage == 0
        post = pp_rank == pp_size - 1 and vp_stage == (vpp or 1) - 1
        model = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(config, layer_spec, stage, pp_rank),
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            vp_stage=stage,
            pg_collection=pg_collection,
            **hf.gpt_model_kwargs(tp, head),
        )
        if head == "value" and post:
            # Built as an LM first (megatron-core has no other output layer); the vocab-sized
            # layer is dropped here, before any optimizer or DDP buffer sees it.
            model.output_layer = ValueHead(
                config.hidden_size,
                sequence_parallel=config.sequence_parallel,
                tp_group=pg_collection.tp,
            )
        chunks.append(model)
    return chunks
