"""tools/demo.py's choice between the shipped warmed-up model and building one."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.tiny.synthetic import make_splits

pytestmark = pytest.mark.unit

TOOLS = REPO_ROOT / "tools"
RECIPE = REPO_ROOT / "recipes" / "demo.yaml"


def load_demo():
    sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("demo_tool", TOOLS / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo():
    return load_demo()


def recipe(tmp_path, *overrides):
    return load_recipe(
        RECIPE,
        [f"model.path={tmp_path}/model", f"data.train_path={tmp_path}/train.jsonl",
         f"data.eval_path={tmp_path}/eval.jsonl", *overrides],
    )  # fmt: skip


def splits(tmp_path, config):
    model = config.model
    return make_splits(tmp_path, model.tiny_num_train, model.tiny_num_eval, model.tiny_seed)[0]


def test_the_shipped_model_is_the_demo_recipes(demo, tmp_path):
    """recipes/demo.yaml's values select the repository's copy, whose stamp it matches."""
    config = recipe(tmp_path)
    stamp = json.loads((demo.SHIPPED_MODEL / "stamp.json").read_text())
    assert stamp["params"]["warmup_steps"] == config.model.tiny_warmup_steps > 0
    assert demo.shipped_model(config, splits(tmp_path, config)) == demo.SHIPPED_MODEL / "model"
    assert (demo.SHIPPED_MODEL / "model" / "config.json").is_file()


def test_other_values_or_data_build_instead(demo, tmp_path, monkeypatch):
    config = recipe(tmp_path)
    train = splits(tmp_path, config)
    for override in ("model.tiny_warmup_steps=7", "model.tiny_slip_rate=0.05", "model.tiny_guess_rate=0.05",
                     "model.tiny_seed=3", "data.template=dapo"):  # fmt: skip
        assert demo.shipped_model(recipe(tmp_path, override), train) is None, override
    # Same values, but a train split of other bytes: the weights were not warmed up on it.
    train.write_text(train.read_text() + "\n")
    assert demo.shipped_model(config, train) is None
    # A copy whose weights do not match its stamp is an error, not a silent use.
    copy = tmp_path / "shipped"
    shutil.copytree(demo.SHIPPED_MODEL, copy)
    monkeypatch.setattr(demo, "SHIPPED_MODEL", copy)
    train = splits(tmp_path, config)
    assert demo.shipped_model(config, train) == copy / "model"
    weights = copy / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="does not match its stamp"):
        demo.shipped_model(config, train)
    # No copy at all: build.
    monkeypatch.setattr(demo, "SHIPPED_MODEL", tmp_path / "none")
    assert demo.shipped_model(config, train) is None
