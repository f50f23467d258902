"""A tiny DeepSeek-V3 with one full MTP layer through the converter with the MTP layer in the
model (``hf-to-mcore --mtp-in-model``, for ``policy.mtp.loss_weight`` > 0): HF -> Megatron at
TP 2 x PP 2 x EP 2 (the MTP layer and the embedding's copy on the last stage) -> HF is
bit-identical, the MTP layer's copies of the lm head and the embedding included; the
checkpoint says where its MTP layers are and has no ``mtp/`` folder; a run that carries MTP
as files refuses it as policy.load, and the other way round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.weights.test_convert import hf_tensors
from tests.launcher import run_workers

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~150 s on 2 busy cores
WORKER = Path(__file__).parent / "workers" / "convert_mtp_worker.py"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.distributed.models.workers.mtp_parity_worker import reference
    from tests.distributed.models.workers.sigmoid_moe_parity_worker import tiny_config

    out = tmp_path_factory.mktemp("hf")
    *_, tensors = reference()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config = tiny_config("deepseek_v3").to_dict() | {"num_nextn_predict_layers": 1}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_round_trip_with_the_mtp_layer_in_the_model(hf_dir: Path, tmp_path: Path) -> None:
    from vapo_megatron.checkpoint.model import load_metadata
    from vapo_megatron.weights.mtp import check_policy_checkpoint

    ckpt, back = tmp_path / "mcore", tmp_path / "back"
    run_workers(WORKER, 4, "save", str(hf_dir), str(ckpt), "2x2x2", timeout=400)
    run_workers(WORKER, 1, "export", str(ckpt), str(back), timeout=400)
    want, got = hf_tensors(hf_dir), hf_tensors(back)
    assert sum(name.startswith("model.layers.4.") for name in got) > 20
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    unequal = [name for name in want if not torch.equal(got[name], want[name])]
    assert not unequal, unequal
    meta = load_metadata(ckpt)
    assert meta.origin["mtp"] == "model" and not (ckpt / "mtp").exists()
    check_policy_checkpoint(meta, trained=True, path=str(ckpt))
    with pytest.raises(ValueError, match="holds its MTP layers in the model"):
        check_policy_checkpoint(meta, trained=False, path=str(ckpt))
