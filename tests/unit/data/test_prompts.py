import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from vapo_megatron.data.prompts import PromptRecord, load_prompts, tokenize_prompts
from vapo_megatron.data.sampler import PromptSampler
from vapo_megatron.data.templates import dapo_instruction, encode_prompt

pytestmark = pytest.mark.unit

# DAPO-Math-17k's parquet schema, as published.
DAPO_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant{% endif %}"
)


def dapo_row(problem, answer, uid):
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": dapo_instruction(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": uid},
    }


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizers_pair():
    """The same tiny word-level vocabulary with and without a chat template (BOS added)."""
    words = dapo_instruction("what is 1 + 2 ? find x twice").split() + ["user", "assistant"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    chat = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    chat.chat_template = CHAT_TEMPLATE
    return plain, chat


def test_dapo_parquet_nested_schema_and_dedup(tmp_path):
    rows = [
        dapo_row("what is 1 + 2 ?", "3", "a"),
        dapo_row("find x", "7", "b"),
        dapo_row("what is 1 + 2 ?", "3", "a2"),
        dapo_row("what is 1 + 2 ?", "4", "c"),  # same prompt, other answer: kept
        dapo_row("find x", "7", "b2"),
    ]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), path)
    records, report = load_prompts(path)
    assert report.schemas == {str(path): "dapo"}
    assert (report.num_rows, report.num_duplicates, report.num_skipped, report.num_kept) == (
        5,
        2,
        0,
        3,
    )
    first = records[0]
    assert first == PromptRecord(
        index=0,
        data_source="math_dapo",
        messages=[{"role": "user", "content": dapo_instruction("what is 1 + 2 ?")}],
        text=dapo_instruction("what is 1 + 2 ?"),
        answer="3",
        extra={"index": "a", "ability": "MATH"},
    )
    assert [(r.index, r.answer) for r in records] == [(0, "3"), (1, "7"), (3, "4")]
    records, report = load_prompts(path, dedup=False)
    assert (report.num_duplicates, report.num_kept) == (0, 5)


def test_plain_jsonl_and_default_data_source(tmp_path):
    rows = [
        {"prompt": "what is 1 + 2 ?", "answer": "3", "level": 1},
        {"prompt": "find x", "answer": "7", "data_source": "aime2024"},
    ]
    path = write_jsonl(tmp_path / "plain.jsonl", rows)
    records, report = load_prompts([path], default_data_source="math")
    assert report.schemas == {str(path): "plain"}
    assert records[0] == PromptRecord(
        index=0,
        data_source="math",
        messages=None,
        text="what is 1 + 2 ?",
        answer="3",
        extra={"level": 1},
    )
    assert records[1].data_source == "aime2024"


def test_bad_rows_are_counted_by_reason_and_logged_once(tmp_path, caplog):
    good = [dapo_row(f"find x {i}", str(i), str(i)) for i in range(10)]
    no_user = dapo_row("find x", "1", "z") | {"prompt": [{"role": "system", "content": "hi"}]}
    bad = [
        "{not json",
        dapo_row("find x", "1", "z") | {"reward_model": {"ground_truth": 5, "style": "rule"}},
        dapo_row("find x", "1", "z") | {"reward_model": {"ground_truth": ["5"], "style": "rule"}},
        dapo_row("find x", "1", "z") | {"reward_model": {"ground_truth": None, "style": "rule"}},
        {k: v for k, v in dapo_row("find x", "1", "z").items() if k != "reward_model"},
        dapo_row("find x", "1", "z") | {"prompt": None},
        dapo_row("find x", "1", "z") | {"prompt": "not a list"},
        dapo_row("find x", "1", "z") | {"prompt": [{"role": "user"}]},
        no_user,
        dapo_row("find x", "1", "z") | {"prompt": [{"role": "user", "content": "  "}]},
        dapo_row("find x", "1", "z") | {"data_source": 3},
    ]
    path = write_jsonl(tmp_path / "dapo.jsonl", good + bad)
    with caplog.at_level(logging.INFO, logger="vapo_megatron.data.prompts"):
        records, report = load_prompts(path, max_bad_fraction=0.6)
    assert len(records) == report.num_kept == 10
    assert report.num_rows == 21
    assert report.skipped == {
        "answer_not_string": 2,
        "bad_data_source": 1,
        "bad_json": 1,
        "bad_messages": 3,
        "empty_prompt": 1,
        "missing_answer": 2,
        "missing_prompt": 1,
    }
    assert len(caplog.records) == 1 and "11 skipped" in caplog.records[0].getMessage()
    with pytest.raises(ValueError, match=r"11 of 21 .*max_bad_fraction=0.5"):
        load_prompts(path, max_bad_fraction=0.5)


def test_plain_rows_with_bad_fields(tmp_path):
    rows = [{"prompt": "find x", "answer": "1"}] * 3 + [
        {"prompt": "find x", "answer": 1},
        {"prompt": ["find x"], "answer": "1"},
        {"prompt": "", "answer": "1"},
        {"answer": "1"},
    ]
    path = write_jsonl(tmp_path / "plain.json", rows)
    records, report = load_prompts(path, dedup=False, max_bad_fraction=0.6)
    assert report.skipped == {
        "answer_not_string": 1,
        "bad_messages": 1,
        "empty_prompt": 1,
        "missing_prompt": 1,
    }
    assert len(records) == 3


def test_unknown_schema_and_extension(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "find x", "solution": "1"}])
    with pytest.raises(ValueError, match=r"\['question', 'solution'\] match no prompt schema"):
        load_prompts(path)
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        load_prompts(write_jsonl(tmp_path / "q.csv", []))


def test_dapo_template_wraps_plain_rows_like_the_published_rows(tokenizers_pair):
    plain_tok, chat_tok = tokenizers_pair
    plain = PromptRecord(
        index=0, data_source="math", messages=None, text="what is 1 + 2 ?", answer="3"
    )
    content = dapo_instruction("what is 1 + 2 ?")
    chat = PromptRecord(
        index=1,
        data_source="math_dapo",
        messages=[{"role": "user", "content": content}],
        text=content,
        answer="3",
    )
    templated = chat_tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
    )
    assert encode_prompt(plain, chat_tok, "dapo") == encode_prompt(chat, chat_tok, "dapo")
    assert encode_prompt(chat, chat_tok, "dapo") == templated
    assert templated[0] == chat_tok.convert_tokens_to_ids("<|im_start|>")
    # No chat template: the instruction as plain text, with the tokenizer's BOS.
    untemplated = encode_prompt(plain, plain_tok, "dapo")
    assert untemplated == encode_prompt(chat, plain_tok, "dapo") == plain_tok(content).input_ids
    assert untemplated[0] == 1 and "<unk>" not in plain_tok.convert_ids_to_tokens(untemplated)


def test_chat_and_raw_templates(tokenizers_pair):
    plain_tok, chat_tok = tokenizers_pair
    record = PromptRecord(index=0, data_source="math", messages=None, text="find x", answer="1")
    ids = encode_prompt(record, chat_tok, "chat")
    assert chat_tok.decode(ids) == "<|im_start|> user find x <|im_end|> <|im_start|> assistant"
    assert encode_prompt(record, plain_tok, "raw") == plain_tok.convert_tokens_to_ids(["find", "x"])
    with pytest.raises(ValueError, match="has none; use template 'dapo'.*or 'raw'"):
        encode_prompt(record, plain_tok, "chat")
    with pytest.raises(ValueError, match=r"'qwen'.*\['dapo', 'chat', 'raw'\]"):
        encode_prompt(record, chat_tok, "qwen")


def test_tokenize_prompts_drops_long_prompts(tokenizers_pair):
    _, chat_tok = tokenizers_pair
    texts = ["find x", "find x twice", "what is 1 + 2 ?"]
    records = [
        PromptRecord(index=i, data_source="math", messages=None, text=t, answer="1")
        for i, t in enumerate(texts)
    ]
    lengths = [len(encode_prompt(r, chat_tok, "chat")) for r in records]
    assert lengths == [7, 8, 11]
    prompts, report = tokenize_prompts(records, chat_tok, "chat", 8, max_bad_fraction=0.5)
    assert [p.record.index for p in prompts] == [0, 1]
    assert prompts[1].token_ids == encode_prompt(records[1], chat_tok, "chat")
    assert (report.num_prompts, report.num_too_long, report.num_kept, report.longest_kept) == (
        3,
        1,
        2,
        8,
    )
    with pytest.raises(ValueError, match="1 of 3 prompts are longer than max_prompt_tokens=8"):
        tokenize_prompts(records, chat_tok, "chat", 8)


def test_sampler_epochs_are_seeded_permutations():
    sampler = PromptSampler(7, seed=3)
    epochs = [sampler.next_indices(7) for _ in range(3)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert epochs[0] != epochs[1] and sampler.epoch == 3
    again = PromptSampler(7, seed=3).next_indices(21)
    assert again == epochs[0] + epochs[1] + epochs[2]
    assert PromptSampler(7, seed=4).next_indices(21) != again
    assert PromptSampler(7, seed=3, shuffle=False).next_indices(9) == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_sampler_resume_mid_epoch_continues_identically():
    run = PromptSampler(10, seed=0)
    run.next_indices(4)
    run.next_indices(4)  # mid-epoch: epoch 0, position 8
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (0, 8)
    expected = run.next_indices(15)  # crosses into epoch 2
    resumed = PromptSampler(10, seed=0)
    resumed.load_state_dict(state)
    assert resumed.next_indices(15) == expected
    with pytest.raises(ValueError, match="seed=0 but this sampler has 1"):
        PromptSampler(10, seed=1).load_state_dict(state)
