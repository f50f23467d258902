"""Two tokenizers are the same when their files give every string the same ids
(data/tokenizer_match.py): each kind of difference is named, roles and templates may differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.data.tokenizer_match import check_same_tokenizer, tokenizer_differences

pytestmark = pytest.mark.unit
SHIPPED = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"
FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(to: Path, edit=None, edit_config=None) -> Path:
    to.mkdir()
    for name in FILES:
        shutil.copyfile(SHIPPED / name, to / name)
    for name, change in (("tokenizer.json", edit), ("tokenizer_config.json", edit_config)):
        if change is not None:
            spec = json.loads((to / name).read_text())
            change(spec)
            (to / name).write_text(json.dumps(spec))
    return to


def swap_two_ids(spec):
    vocab = spec["model"]["vocab"]
    vocab["+"], vocab["-"] = vocab["-"], vocab["+"]


def test_the_same_tokenizer_matches_whatever_its_roles_and_templates(tmp_path):
    def roles(config):  # a reward model's eos is often the chat's end-of-turn token
        config.update(eos_token="<|pad|>", model_max_length=4096, chat_template="{{ x }}")

    critic = copy_tokenizer(tmp_path / "critic", edit_config=roles)
    assert tokenizer_differences(SHIPPED, critic) == []
    check_same_tokenizer(SHIPPED, critic)


def test_a_vocabulary_of_the_same_size_with_other_ids_is_refused_naming_them(tmp_path):
    critic = copy_tokenizer(tmp_path / "critic", edit=swap_two_ids)
    with pytest.raises(ValueError) as err:
        check_same_tokenizer(SHIPPED, critic)
    text = str(err.value)
    assert f"the critic's model {critic} has another tokenizer than the policy's" in text
    assert "vocabulary (" in text and "2 differ ('+':" in text and "'-':" in text
    assert "merges" not in text


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda s: s["model"]["merges"].reverse(), "merges ("),
        (lambda s: s["model"]["vocab"].pop("+"), "1 only in the policy's ('+':"),
        (
            lambda s: s["added_tokens"].append({"id": 999, "content": "<|im_end|>", "special": True}),
            "added/special tokens (by id) (4 and 5 entries): 1 only in the critic's (999: ('<|im_end|>', True))",
        ),
        (lambda s: s["added_tokens"][1].update(special=False), "1 differ (1: ('<|pad|>', True) != ('<|pad|>', False))"),
        (lambda s: s.update(pre_tokenizer={"type": "ByteLevel"}), "pre_tokenizer: "),
    ],
    ids=["merges", "vocabulary", "added_token", "special_flag", "pre_tokenizer"],
)  # fmt: skip
def test_each_part_that_decides_ids_is_compared(tmp_path, edit, named):
    differ = tokenizer_differences(SHIPPED, copy_tokenizer(tmp_path / "critic", edit=edit))
    assert len(differ) == 1 and named in differ[0], differ


def test_slow_tokenizer_files_and_a_directory_without_any(tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    spec = json.loads((SHIPPED / "tokenizer.json").read_text())
    (slow / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = ["#version: 0.2"] + [" ".join(m) for m in spec["model"]["merges"]]
    (slow / "merges.txt").write_text("\n".join(merges) + "\n")
    differ = tokenizer_differences(slow, tmp_path / "slow")
    assert differ == []
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="has no tokenizer files"):
        tokenizer_differences(SHIPPED, tmp_path / "none")
