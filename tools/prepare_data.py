"""Write the prompt files the recipes read (data/dapo-math-17k.parquet, data/aime-2024.parquet).

    python tools/prepare_data.py dapo-math-17k --source SRC --out FILE
    python tools/prepare_data.py aime-2024 --source SRC --out FILE

SRC is a local ``.parquet`` / ``.jsonl`` / ``.json`` (JSON lines) file, or a Hugging Face
dataset id (``BytedTsinghua-SIA/DAPO-Math-17k``), downloaded here with ``huggingface_hub``:
run it on the login node, compute nodes stay offline. The rows are read and checked by the
trainer's own loader (``vapo_megatron/data/prompts.py``), repeats of a (prompt, answer) are
dropped (DAPO-Math-17k holds each prompt ~100 times), and each answer is kept as the string
the grader compares (``rewards/dapo_math.py``): a row whose answer the grader cannot match even
in a response that states it exactly ("Answer: <answer>"), or that normalises to nothing, is
skipped as ``answer_not_gradable``.

aime-2024 also takes plain releases: a problem column (``problem``, ``Problem``, ``question``,
``Question``, ``prompt``) and an answer column (``answer``, ``Answer``, ``final_answer``,
``expected_answer``, ``ground_truth``); integer answers become their decimal string.

The output is parquet in DAPO-Math-17k's schema (``data_source``, ``prompt`` as one user
message carrying DAPO's instruction, ``ability``, ``reward_model.ground_truth``,
``extra_info.index``), so the trainer's ``dapo`` template gives the same tokens as for the
published files. Printed: rows read, duplicates, skipped rows by reason, rows kept, then one
JSON line ``{"rows_read": N, "duplicates": N, "skipped": {reason: N}, "kept": N}``.
Exit status: 0 written, 2 bad input (the message says what to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vapo_megatron.data.prompts import (  # noqa: E402
    DAPO_COLUMNS,
    PLAIN_COLUMNS,
    PromptRecord,
    load_prompts,
)
from vapo_megatron.data.templates import dapo_instruction  # noqa: E402
from vapo_megatron.rewards.dapo_math import grade, normalize_final_answer  # noqa: E402

DATASETS = {"dapo-math-17k": "math_dapo", "aime-2024": "aime2024"}
"""Command -> data_source written for rows that carry none (both route to DAPO's grader)."""
PROBLEM_COLUMNS = ("problem", "Problem", "question", "Question", "prompt")
"""Spellings of the problem column in plain AIME releases, in the order tried."""
ANSWER_COLUMNS = ("answer", "Answer", "final_answer", "expected_answer", "ground_truth")
"""Spellings of the answer column in plain AIME releases, in the order tried."""
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
OUTPUT_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)
"""DAPO-Math-17k's published parquet schema."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        files = source_files(args.source)
        summary = prepare(args.dataset, files, Path(args.out), args.max_bad_fraction)
    except ValueError as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_data.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument(
        "--source",
        required=True,
        help="local .parquet/.jsonl file, or a Hugging Face dataset id (downloaded here)",
    )
    parser.add_argument("--out", required=True, help="parquet file to write")
    parser.add_argument(
        "--max-bad-fraction",
        type=float,
        default=0.01,
        help="refuse the source when more than this fraction of its rows is unusable",
    )
    return parser


def source_files(source: str) -> list[Path]:
    """The data files of SRC: the local file itself, or those of a downloaded HF dataset."""
    path = Path(source)
    if path.is_file():
        return [path]
    if path.exists() or source.startswith((".", "/")) or source.count("/") != 1:
        raise ValueError(
            f"--source {source}: not a data file here and not a Hugging Face dataset id "
            "(owner/name); give a .parquet/.jsonl file or an id such as "
            "BytedTsinghua-SIA/DAPO-Math-17k"
        )
    from huggingface_hub import snapshot_download

    print(f"downloading dataset {source} from the Hugging Face Hub")
    local = Path(
        snapshot_download(
            repo_id=source, repo_type="dataset", allow_patterns=[f"*{s}" for s in DATA_SUFFIXES]
        )
    )
    files = sorted(p for p in local.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    if not files:
        raise ValueError(f"dataset {source} (in {local}) holds no .parquet/.jsonl/.json file")
    return files


def prepare(dataset: str, files: list[Path], out: Path, max_bad_fraction: float) -> dict:
    """Reads, checks, deduplicates and writes; returns the summary printed as JSON."""
    data_source = DATASETS[dataset]
    with tempfile.TemporaryDirectory() as tmp:
        inputs = [
            _as_plain_jsonl(f, Path(tmp) / f"{i}.jsonl", data_source)
            if dataset == "aime-2024"
            else f
            for i, f in enumerate(files)
        ]
        records, report = load_prompts(
            inputs,
            default_data_source=data_source,
            dedup=True,
            max_bad_fraction=max_bad_fraction,
        )
    skipped = Counter(report.skipped)
    kept = []
    for record in records:
        if not gradable(record.answer):
            skipped["answer_not_gradable"] += 1
            continue
        kept.append(record)
    num_skipped = sum(skipped.values())
    if num_skipped > max_bad_fraction * report.num_rows:
        raise ValueError(
            f"{num_skipped} of {report.num_rows} rows are unusable ({dict(skipped)}), more than "
            f"--max-bad-fraction={max_bad_fraction}: check --source, or raise the fraction"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([_row(r) for r in kept], schema=OUTPUT_SCHEMA), out)
    print(f"rows read:  {report.num_rows} from {', '.join(str(f) for f in files)}")
    print(f"duplicates: {report.num_duplicates}")
    print(f"skipped:    {num_skipped} {dict(sorted(skipped.items()))}")
    print(f"kept:       {len(kept)} -> {out}")
    return {
        "rows_read": report.num_rows,
        "duplicates": report.num_duplicates,
        "skipped": dict(sorted(skipped.items())),
        "kept": len(kept),
    }


def gradable(answer: str) -> bool:
    """Whether DAPO's grader credits a response that states ``answer`` exactly, and the answer
    normalises to something (an empty one would credit any answer made only of units)."""
    return bool(normalize_final_answer(answer)) and grade(f"Answer: {answer}", answer).acc == 1.0


def _as_plain_jsonl(path: Path, tmp: Path, data_source: str) -> Path:
    """An AIME file as the loader's plain schema (or the file itself when it already is one)."""
    columns = _columns(path)
    if all(c in columns for c in DAPO_COLUMNS) or all(c in columns for c in PLAIN_COLUMNS):
        return path
    problem = next((c for c in PROBLEM_COLUMNS if c in columns), None)
    answer = next((c for c in ANSWER_COLUMNS if c in columns), None)
    if problem is None or answer is None:
        raise ValueError(
            f"{path}: columns {sorted(columns)} hold no AIME problems. Accepted: DAPO's release "
            f"({', '.join(DAPO_COLUMNS)}), or a problem column ({', '.join(PROBLEM_COLUMNS)}) "
            f"with an answer column ({', '.join(ANSWER_COLUMNS)})"
        )
    with tmp.open("w", encoding="utf-8") as f:
        for row in _rows(path):
            if row is None:  # not a JSON object: the loader counts it as bad_json
                f.write("null\n")
                continue
            value = row.get(answer)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                value = str(value)  # AIME answers are integers 0..999; the grader reads strings
            plain = {"prompt": row.get(problem), "answer": value}
            plain["data_source"] = row.get("data_source") or data_source
            for key in ("id", "ID", "problem_idx", "url"):
                if row.get(key) is not None:
                    plain["id"] = str(row[key])
                    break
            f.write(json.dumps(plain) + "\n")
    print(f"{path}: problem column {problem!r}, answer column {answer!r}")
    return tmp


def _columns(path: Path) -> set[str]:
    if path.suffix == ".parquet":
        return set(pq.ParquetFile(path).schema_arrow.names)
    return {key for row in _rows(path) if row is not None for key in row}


def _rows(path: Path) -> list[dict[str, Any] | None]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                rows.append(row if isinstance(row, dict) else None)
    return rows


def _row(record: PromptRecord) -> dict[str, Any]:
    """A record in DAPO-Math-17k's schema; plain problems get DAPO's instruction around them."""
    if record.messages is None:
        messages = [{"role": "user", "content": dapo_instruction(record.text)}]
        index = str(record.extra.get("id", record.index))
    else:
        messages = record.messages
        index = str(record.extra.get("index", record.index))
    return {
        "data_source": record.data_source,
        "prompt": [{"content": m["content"], "role": m["role"]} for m in messages],
        "ability": str(record.extra.get("ability", "MATH")),
        "reward_model": {"ground_truth": record.answer, "style": "rule"},
        "extra_info": {"index": index},
    }


if __name__ == "__main__":
    sys.exit(main())
