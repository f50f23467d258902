"""Worker: checkpoints of one layer spec load into models of the other; only _extra_state gives.

Usage: python te_checkpoint_worker.py OUT_DIR (2 ranks, TP 2). Writes ``rank{r}.json``: per
case, "ok" with what was checked, or the error's type and message.

A model built with Transformer Engine's spec asks the checkpoint for the same weight keys as the
local spec's model (megatron maps the local norm keys to TE's) plus one ShardedObject the local
spec never saves: ``decoder.final_layernorm._extra_state`` (TE >= 1.13's RMSNorm carries one;
TE's linears' ``_extra_state`` keys exist under the local spec too, holding None). TE cannot run
here, so the TE model is the local model whose final norm is given TE's extra-state hooks: its
sharded state dict then has exactly that key, built by megatron's own code
(``make_sharded_tensors_for_checkpoint`` on the module's state_dict, as for TE's norm).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.unit.weights.test_record import qwen2_config
from vapo_megatron.checkpoint import model as ckpt
from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.norm import RMSNorm
from vapo_megatron.models.provider import build_model, transformer_config
from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

TP = 2
HF_CONFIG = qwen2_config(heads=4, kv_heads=2, layers=2)


class TEStyleRMSNorm(RMSNorm):
    """The norm with TE's extra-state protocol: a byte tensor out, and whatever comes back in
    is recorded (TE ignores None and empty tensors)."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([7, 7, 7], dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        self.extra_state_loaded = state


def build(seed: int, *, te_style: bool = False, extra_weight: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = HFModelConfig.from_hf(HF_CONFIG)
    (model,) = build_model(hf, transformer_config(hf, ModelLayout(tp=TP)), head="lm")
    norm = model.decoder.final_layernorm
    if te_style:
        norm.__class__ = TEStyleRMSNorm
    if extra_weight:  # a real tensor only one side has
        norm.register_parameter("bias", torch.nn.Parameter(torch.zeros_like(norm.weight)))
    return model


def save(model: torch.nn.Module, directory: Path) -> None:
    meta = ckpt.make_metadata(HF_CONFIG, head="lm", tp=TP, pp=1, dtype=torch.float32)
    ckpt.save_model_weights([model], directory, meta)


def load(model: torch.nn.Module, directory: Path) -> dict:
    """Load and report: tolerated-entries log lines, or the error."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("vapo_megatron.checkpoint.model")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ckpt.load_model_weights([model], directory, hf=HFModelConfig.from_hf(HF_CONFIG), head="lm")
    except Exception as err:  # reported, and the test checks its type
        return {"error": type(err).__name__, "message": str(err)}
    finally:
        logger.removeHandler(handler)
    return {"log": records}


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return all(torch.equal(pa[name], pb[name]) for name in pa if name in pb)


def main(out_dir: str) -> None:
    initialize_megatron_cpu(tp=TP)
    rank = dist.get_rank()
    root = Path(out_dir)
    report: dict[str, dict] = {}

    local = build(1)
    save(local, root / "local")
    te_model = build(2, te_style=True)
    save(te_model, root / "te")
    with_extra = build(3, extra_weight=True)
    save(with_extra, root / "extra")

    # The same spec both ways: nothing to tolerate.
    fresh = build(4)
    report["local->local"] = load(fresh, root / "local") | {"equal": same_weights(fresh, local)}
    # A TE model, a local-spec checkpoint (what tools/convert.py writes): one key tolerated.
    fresh_te = build(5, te_style=True)
    result = load(fresh_te, root / "local")
    result["equal"] = same_weights(fresh_te, local)
    result["extra_state_loaded"] = hasattr(fresh_te.decoder.final_layernorm, "extra_state_loaded")
    report["local->te"] = result
    # A local model, a TE checkpoint: its extra key is left unread.
    fresh = build(6)
    report["te->local"] = load(fresh, root / "te") | {"equal": same_weights(fresh, te_model)}
    # A real weight the checkpoint lacks: refused (by every rank).
    report["missing weight"] = load(build(7, te_style=True, extra_weight=True), root / "local")
    # A real weight in the checkpoint that the model does not have: refused.
    report["unexpected weight"] = load(build(8), root / "extra")

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    destroy()


if __name__ == "__main__":
    main(sys.argv[1])
