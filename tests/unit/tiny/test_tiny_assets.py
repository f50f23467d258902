"""model.create_tiny: the tiny task's splits are written where missing, under the names the
recipe gives, and a model directory that is already there is left as it is."""

import json

import pytest
import torch.distributed as dist

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.tiny.assets import ensure_tiny_assets, write_missing_tiny_assets

pytestmark = pytest.mark.unit
TINY = REPO_ROOT / "recipes" / "tiny_cpu.yaml"


def tiny_config(tmp_path, train="train.jsonl", eval_="eval.jsonl", *extra):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"note": "stands in for the tiny model"}))
    return load_recipe(TINY, [
        f"model.path={model}", f"data.train_path={tmp_path / train}",
        f"data.eval_path={tmp_path / eval_}", "model.tiny_num_train=30",
        "model.tiny_num_eval=10", *extra,
    ])  # fmt: skip


def test_missing_splits_are_written_and_present_ones_kept(tmp_path):
    config = tiny_config(tmp_path)
    write_missing_tiny_assets(config.model, config.data)
    train, eval_ = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    assert len(train.read_text().splitlines()) == 30
    assert len(eval_.read_text().splitlines()) == 10
    train.write_text("kept\n")
    eval_.write_text("kept\n")
    write_missing_tiny_assets(config.model, config.data)
    assert train.read_text() == eval_.read_text() == "kept\n"
    assert json.loads((tmp_path / "model" / "config.json").read_text())["note"]


def test_other_split_names_are_refused_with_the_names_it_writes(tmp_path):
    config = tiny_config(tmp_path, "mine.jsonl")
    with pytest.raises(ValueError, match=r"writes .*train\.jsonl and .*eval\.jsonl; set"):
        write_missing_tiny_assets(config.model, config.data)


def test_every_rank_returns_once_they_are_there(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    host = dist.new_group(backend="gloo")
    ensure_tiny_assets(tiny_config(tmp_path, "train.jsonl", "eval.jsonl",
                                   "model.create_tiny=false"), host)  # fmt: skip
    assert not (tmp_path / "train.jsonl").exists()
    ensure_tiny_assets(tiny_config(tmp_path), host)
    assert (tmp_path / "train.jsonl").is_file() and (tmp_path / "eval.jsonl").is_file()
