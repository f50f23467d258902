"""Worker: the names of a model megatron-core builds with Transformer Engine's layer spec.

Usage: python te_names_worker.py OUT_JSON. One process standing in, under torch's fake
backend (``planning.dry_run.stand_in_for``), for one rank of every pipeline stage of each case
of ``tests/unit/weights/test_te_names.py`` at TP 2, PP 1 and 2. TE cannot be installed here, so
megatron's ``get_gpt_layer_with_transformer_engine_spec`` gets stand-ins of TE's modules that
register what TE 2.11's do (``FakeTESpecProvider``); which modules exist, and where, is
megatron's own code and the project's ``build_model`` (the output layer, the value head, the
final norm). Writes {"case/pp/stage": {"parameters": [...], "state_dict": [...]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import transformer_block

from tests.unit.weights import test_te_names as te
from vapo_megatron.config.layout import ModelLayout, layout_sizes
from vapo_megatron.models import provider
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.parallel.model_groups import build_model_groups, rank_groups
from vapo_megatron.planning.dry_run import on_meta, stand_in_for


def names_of(case: str, pp: int, rank: int) -> tuple[int, dict]:
    hf_config, head = te.CASES[case]
    hf = HFModelConfig.from_hf(hf_config)
    with stand_in_for(rank, te.TP * pp):
        groups = build_model_groups(tp=te.TP, pp=pp, cp=1, host=dist.group.WORLD)
        layout = ModelLayout(tp=te.TP, pp=pp)
        config = provider.transformer_config(hf, layout, use_cpu_initialization=True)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        with on_meta():
            (model,) = provider.build_model(
                hf, config, head=head, pg_collection=groups.pg_collection, layer_spec=spec
            )
        names = {
            "parameters": [n for n, _ in model.named_parameters()],
            "state_dict": list(model.state_dict()),
        }
        return groups.pp_rank, names


def main(out: str) -> None:
    gpt_layer_specs.TESpecProvider = te.FakeTESpecProvider
    # The block's final norm: TENorm where TE imports (transformer_block.LayerNormImpl).
    transformer_block.LayerNormImpl = te.TENorm
    found = {}
    for case in te.CASES:
        for pp in (1, 2):
            sizes = layout_sizes(tp=te.TP, pp=pp, cp=1, world_size=te.TP * pp)
            first_pipeline = rank_groups(sizes, "pp")[0]
            for rank in first_pipeline:
                stage, names = names_of(case, pp, rank)
                found[f"{case}/{pp}/{stage}"] = names
    Path(out).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
