"""tools/prepare_data.py on local fixtures: DAPO-Math-17k and the AIME 2024 releases."""

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron.data.prompts import load_prompts
from vapo_megatron.data.templates import dapo_instruction

pytestmark = pytest.mark.unit
TOOL = REPO_ROOT / "tools" / "prepare_data.py"
DAPO_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)


def dapo_row(problem, answer, uid, source="math_dapo"):
    return {
        "data_source": source,
        "prompt": [{"content": dapo_instruction(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": uid},
    }


def run(*args):
    done = subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return done


def summary(done):
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dapo_math_17k_dedups_and_keeps_answers_as_written(tmp_path):
    rows = [dapo_row("What is 2+2?", "4", "a")] * 5 + [dapo_row("Sum of 1..3?", "6", "b")] * 3
    rows.append(dapo_row("Half of 1?", "\\frac{1}{2}", "c"))
    rows.append({**dapo_row("Broken", "1", "d"), "prompt": []})  # bad message list
    src, out = tmp_path / "dapo.parquet", tmp_path / "data" / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), src)
    done = run("dapo-math-17k", "--source", src, "--out", out, "--max-bad-fraction", "0.2")
    assert summary(done) == {
        "rows_read": 10, "duplicates": 6, "skipped": {"bad_messages": 1}, "kept": 3,
    }  # fmt: skip
    assert "duplicates: 6" in done.stdout and "kept:       3" in done.stdout
    assert pq.read_schema(out).equals(DAPO_SCHEMA)
    records, report = load_prompts(out, dedup=True)
    assert report.schemas[str(out)] == "dapo" and report.num_duplicates == 0
    assert [r.answer for r in records] == ["4", "6", "\\frac{1}{2}"]
    assert records[0].messages == rows[0]["prompt"]  # the instruction as published
    assert records[0].extra["index"] == "a"


def test_too_many_bad_rows_is_refused(tmp_path):
    rows = [dapo_row("What is 2+2?", "4", "a"), {**dapo_row("Broken", "1", "d"), "prompt": []}]
    src = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), src)
    done = run("dapo-math-17k", "--source", src, "--out", tmp_path / "out.parquet")
    assert done.returncode == 2
    assert "1 of 2 prompt rows are unusable" in done.stderr
    assert not (tmp_path / "out.parquet").exists()


def test_aime_dapo_release_is_deduplicated(tmp_path):
    rows = [dapo_row(f"AIME problem {i}", str(100 + i), str(i)) for i in range(3)] * 4
    src, out = tmp_path / "aime.parquet", tmp_path / "aime-2024.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=DAPO_SCHEMA), src)
    assert summary(run("aime-2024", "--source", src, "--out", out)) == {
        "rows_read": 12, "duplicates": 9, "skipped": {}, "kept": 3,
    }  # fmt: skip
    records, _ = load_prompts(out)
    assert [r.answer for r in records] == ["100", "101", "102"]


@pytest.mark.parametrize(
    ("problem", "answer", "suffix"),
    [("Problem", "Answer", ".parquet"), ("problem", "answer", ".jsonl"),
     ("question", "final_answer", ".jsonl")],
)  # fmt: skip
def test_aime_plain_releases_under_their_spellings(tmp_path, problem, answer, suffix):
    rows = [
        {"ID": "2024-I-1", problem: "Find x.", answer: 204, "Solution": "..."},
        {"ID": "2024-I-2", problem: "Find y.", answer: "025", "Solution": "..."},
        {"ID": "2024-I-1", problem: "Find x.", answer: 204, "Solution": "..."},
    ]
    src, out = tmp_path / f"aime{suffix}", tmp_path / "aime-2024.parquet"
    if suffix == ".parquet":
        rows[1][answer] = 25  # one column type per parquet file
        pq.write_table(pa.Table.from_pylist(rows), src)
    else:
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run("aime-2024", "--source", src, "--out", out)
    assert summary(done) == {"rows_read": 3, "duplicates": 1, "skipped": {}, "kept": 2}
    assert f"problem column {problem!r}, answer column {answer!r}" in done.stdout
    records, _ = load_prompts(out)
    assert [r.answer for r in records] == ["204", "25" if suffix == ".parquet" else "025"]
    assert records[0].data_source == "aime2024"
    assert records[0].messages == [{"role": "user", "content": dapo_instruction("Find x.")}]
    assert records[0].extra["index"] == "2024-I-1"


def test_aime_answers_the_grader_cannot_match_are_skipped(tmp_path):
    rows = [{"problem": f"P{i}", "answer": "7"} for i in range(250)]
    rows.append({"problem": "P-empty", "answer": "x = "})  # normalises to nothing
    rows.append({"problem": "P-lines", "answer": "12\n13"})  # a response's answer is one line
    src = tmp_path / "aime.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = summary(run("aime-2024", "--source", src, "--out", tmp_path / "out.parquet"))
    assert got == {"rows_read": 252, "duplicates": 0, "skipped": {"answer_not_gradable": 2},
                   "kept": 250}  # fmt: skip


def test_aime_names_the_columns_it_found(tmp_path):
    src = tmp_path / "aime.jsonl"
    src.write_text(json.dumps({"statement": "Find x.", "solution_text": "204"}) + "\n")
    done = run("aime-2024", "--source", src, "--out", tmp_path / "out.parquet")
    assert done.returncode == 2
    assert "columns ['solution_text', 'statement'] hold no AIME problems" in done.stderr
    assert "Problem" in done.stderr and "Answer" in done.stderr


def test_a_missing_local_source_is_not_taken_for_a_dataset_id(tmp_path):
    done = run("aime-2024", "--source", tmp_path / "nope.parquet", "--out", tmp_path / "o.parquet")
    assert done.returncode == 2
    assert "not a data file here and not a Hugging Face dataset id" in done.stderr


def test_a_dataset_id_is_downloaded_and_its_data_files_read(tmp_path, monkeypatch):
    import huggingface_hub

    sys.path.insert(0, str(TOOL.parent))
    import prepare_data

    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "README.md").write_text("card")
    rows = [{"problem_idx": 1, "problem": "Find x.", "answer": 204}]
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / "train-0.parquet")
    calls = []

    def fake_download(**kwargs):
        calls.append(kwargs)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    files = prepare_data.source_files("MathArena/aime_2024_I")
    assert files == [snapshot / "data" / "train-0.parquet"]
    assert calls == [{"repo_id": "MathArena/aime_2024_I", "repo_type": "dataset",
                      "allow_patterns": ["*.parquet", "*.jsonl", "*.json"]}]  # fmt: skip
    out = tmp_path / "aime.parquet"
    assert prepare_data.prepare("aime-2024", files, out, 0.01)["kept"] == 1
    records, _ = load_prompts(out)
    assert records[0].answer == "204" and records[0].extra["index"] == "1"
