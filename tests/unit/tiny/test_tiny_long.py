"""The long-trace task's tiny models (issue 29), built small: the warmed-up policy directory and
the outcome reward model on the policy's trunk, loadable as a critic's reward model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from vapo_megatron.tiny.long_model import (
    last_token_values,
    sample,
    token_values,
    write_long_policy,
    write_reward_model,
)
from vapo_megatron.tiny.long_trace import make_rows, make_splits, read_rows, solve
from vapo_megatron.tiny.model import tiny_qwen2_config, train_tokenizer
from vapo_megatron.weights.critic import VALUE_HEAD, reward_model_hf_tensors

pytestmark = pytest.mark.unit


def test_policy_and_reward_model_build_small(tmp_path):
    train, evals = make_splits(tmp_path, 48, 4, seed=0)
    policy_dir, orm_dir = tmp_path / "model", tmp_path / "reward_model"
    write_long_policy(policy_dir, train_path=train, eval_path=evals, seed=0, warmup_steps=3,
                      slip_rate=0.05, warmup_problems=32, batch_size=4)  # fmt: skip
    policy = AutoModelForCausalLM.from_pretrained(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    assert (
        tokenizer.decode(tokenizer("1 a:97+5=2\nAnswer: 2")["input_ids"]) == "1 a:97+5=2\nAnswer: 2"
    )

    result = write_reward_model(orm_dir, policy_dir=policy_dir, rows=read_rows(train)[:4], seed=0,
                                steps=2, batch_size=2)  # fmt: skip
    assert result["samples"] == 4 and 0.0 <= result["samples_pass_rate"] <= 1.0
    orm = AutoModelForSequenceClassification.from_pretrained(orm_dir)
    assert orm.config.num_labels == 1 and orm.score.weight.shape == (1, 128)
    assert VALUE_HEAD in reward_model_hf_tensors(orm_dir)  # what critic.init_path reads
    # The ORM's value at a sequence's last token is HF's sequence-classification logit.
    ids = [tokenizer("Run 4 steps from 3: a=+1 b=-2")["input_ids"] + [5, 6, 7]]
    ours = last_token_values(orm, ids, tokenizer.pad_token_id)
    with torch.no_grad():
        theirs = orm(input_ids=torch.tensor(ids)).logits[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-6)
        assert torch.allclose(token_values(orm, ids[0])[-1], theirs[0], atol=1e-6)

    # Samples come back in the rows' order, graded by the verifier.
    rows = read_rows(evals)
    samples = sample(
        policy, tokenizer, rows, temperature=1.0, seed=0, max_new_tokens=8, batch_size=3
    )
    assert [s["prompt_tokens"] for s in samples] == [
        len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows
    ]
    assert all(s["score"] in (-1.0, 1.0) for s in samples)


def test_prompts_match_the_loaded_tokenizer_and_values_are_one_token(tmp_path):
    """transformers loads the tiny tokenizer as a Qwen2Tokenizer, whose pre-tokenizer splits
    every digit; the prompts have one-digit numbers only, so they are the same tokens either
    way, and the responses' values 0..99 are one token each of the trained tokenizer (the
    tokenizer of a full build: the 2000 training problems of seed 0)."""
    rows = make_rows(2000, 0)
    trained = train_tokenizer([t for r in rows for t in (r["prompt"], solve(r["prompt"])[1])])
    trained.save_pretrained(tmp_path)
    tiny_qwen2_config(trained).save_pretrained(tmp_path)  # model_type qwen2 picks the class
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for row in make_rows(200, 1):
        ids = loaded(row["prompt"], add_special_tokens=False)["input_ids"]
        assert ids == trained(row["prompt"], add_special_tokens=False)["input_ids"]
    assert all(len(trained(str(v), add_special_tokens=False)["input_ids"]) == 1 for v in range(100))
    # What the Qwen2 pre-tokenizer does to a two-digit number (why prompts have none).
    assert len(loaded("97", add_special_tokens=False)["input_ids"]) == 2
