"""Worker: the names of a model megatron-core builds with Transformer Engine's layer spec.

Usage: python te_names_worker.py OUT_JSON. One process standing in, under torch's fake
backend (``planning.dry_run.stand_in_for``), for one rank of every (pipeline stage, EP rank)
of each case of ``tests/unit/weights/test_te_names.py`` at TP 2, PP 1 and 2 (EP 2 cases: world
4 * PP, expert TP 2). TE cannot be installed here, so megatron's
``get_gpt_layer_with_transformer_engine_spec`` gets stand-ins of TE's modules that register what
TE 2.11's do (``FakeTESpecProvider``: the dense, norm, grouped-GEMM and expert linears); which
modules exist, and where, is megatron's own code (``MoELayer``, ``TEGroupedMLP``,
``SequentialMLP``, the router) and the project's ``build_model`` (the output layer, the value
head, the final norm). For the MoE cases at PP 1 the same rank also builds the local spec
(``provider.local_spec``) and both models' distributed-checkpoint keys are written, so that the
test can hold the local spec's key map against TE's layer names.

Writes {"case/pp/stage/ep_rank": {"parameters": [...], "state_dict": [...],
"checkpoint_keys": {"te": [...], "local": [...]} (MoE cases, PP 1)}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import transformer_block

from tests.unit.weights import test_te_names as te
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models import provider
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.model_groups import build_model_groups
from vapo_megatron.planning.dry_run import on_meta, stand_in_for


def layout_of(case: te.Case, pp: int, hf: HFModelConfig) -> tuple[ModelLayout, int]:
    """The case's layout and world size (EP 2 with expert TP = TP 2 needs 4 ranks a stage)."""
    ep = case.ep if hf.is_moe else 1
    layout = ModelLayout(tp=te.TP, pp=pp, ep=ep, sequence_parallel=te.TP > 1 and ep > 1)
    return layout, te.TP * pp * ep


def checkpoint_keys(model, groups) -> list[str]:
    """The keys of ``model``'s distributed checkpoint (``GPTModel.sharded_state_dict``, after
    each layer's ``sharded_state_dict_keys_map``) outside the routed experts, ``_extra_state``
    left out. The experts' keys are megatron's TE wrappers' own code (``TEGroupedLinear
    ._sharded_state_dict_grouped``), which the stand-ins do not copy: their module is left out
    of the walk."""
    for layer in model.decoder.layers:
        layer.mlp.experts.sharded_state_dict = lambda *args, **kwargs: {}
    sharded = model.sharded_state_dict(metadata={"dp_cp_group": groups.pg_collection.dp_cp})
    return sorted({v.key for v in sharded.values() if not v.key.endswith("_extra_state")})


def names_of(case_name: str, pp: int, rank: int, found: dict) -> None:
    """Put the names of the model rank ``rank`` builds in ``found``, unless an earlier rank
    covered its (stage, EP rank) or it is not TP rank 0."""
    case = te.CASES[case_name]
    hf = HFModelConfig.from_hf(case.hf_config)
    layout, world = layout_of(case, pp, hf)
    with stand_in_for(rank, world):
        groups = build_model_groups(
            tp=te.TP, pp=pp, cp=1, host=dist.group.WORLD, ep=layout.ep, etp=layout.etp
        )
        key = f"{case_name}/{pp}/{groups.pp_rank}/{groups.ep_rank}"
        if groups.tp_rank != 0 or key in found:
            return
        config = provider.transformer_config(hf, layout, use_cpu_initialization=True)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=hf.num_experts or None,
            moe_grouped_gemm=case.grouped,
            qk_layernorm=hf.qk_layernorm,
        )
        assert provider.uses_grouped_experts(spec) == case.grouped
        build = {"head": case.head, "pg_collection": groups.pg_collection}
        with on_meta():
            (model,) = provider.build_model(hf, config, layer_spec=spec, **build)
            names = {
                "parameters": [n for n, _ in model.named_parameters()],
                "state_dict": list(model.state_dict()),
            }
            if hf.is_moe and pp == 1:  # PP 2's tied copy reads parallel_state's DP group
                (local,) = provider.build_model(
                    hf, config, layer_spec=provider.local_spec(hf), **build
                )
                names["checkpoint_keys"] = {
                    "te": checkpoint_keys(model, groups),
                    "local": checkpoint_keys(local, groups),
                }
        found[key] = names


def main(out: str) -> None:
    gpt_layer_specs.TESpecProvider = te.FakeTESpecProvider
    # The block's final norm: TENorm where TE imports (transformer_block.LayerNormImpl).
    transformer_block.LayerNormImpl = te.TENorm
    found = {}
    for case_name, case in te.CASES.items():
        hf = HFModelConfig.from_hf(case.hf_config)
        for pp in (1, 2):
            _, world = layout_of(case, pp, hf)
            for rank in range(world):
                names_of(case_name, pp, rank, found)
    Path(out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
