"""Prompt datasets: rows from parquet or JSONL files -> typed records -> prompt token ids.

Two row schemas are accepted, detected per file from its columns:

- ``dapo``: DAPO-Math-17k as published (``BytedTsinghua-SIA/DAPO-Math-17k``): ``data_source``,
  ``prompt`` (a chat message list ``[{"role": "user", "content": ...}]``), ``ability``,
  ``reward_model`` (``{"ground_truth": str, "style": "rule"}``) and ``extra_info``.
- ``plain``: ``{"prompt": str, "answer": str}`` with an optional ``data_source``.

A row that cannot be used (missing field, empty prompt, non-string answer, malformed message
list, unparsable JSON line) is skipped and counted by reason; past ``max_bad_fraction`` of the
rows read the load fails, since that many bad rows means a wrong file or schema, not noise.
The published DAPO-Math-17k holds each of its ~17k prompts ~100 times (1.79M rows);
``dedup=True`` keeps the first of each (prompt, answer).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from vapo_megatron.data.templates import encode_prompt

logger = logging.getLogger(__name__)

Schema = Literal["dapo", "plain"]

DAPO_COLUMNS = ("prompt", "reward_model")
"""Columns that make a file the DAPO-Math-17k schema (data_source, ability, extra_info optional)."""
PLAIN_COLUMNS = ("prompt", "answer")
"""Columns that make a file the plain schema (data_source optional)."""
_PARQUET_BATCH_ROWS = 65536


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One usable prompt row."""

    index: int
    """Row number among all rows read, over the files in the order given (0-based)."""
    data_source: str
    """Which grader scores its responses (``reward.routing`` maps it to one)."""
    messages: list[dict[str, str]] | None
    """The chat message list of chat-form (DAPO) rows, each with 'role' and 'content'; None for plain rows."""
    text: str
    """The problem as written: the last user message's content for chat-form rows, else the prompt."""
    answer: str
    """Ground-truth answer the grader compares against."""
    extra: dict[str, Any] = field(default_factory=dict)
    """DAPO rows: extra_info plus 'ability' when present. Plain rows: the row's other columns."""


@dataclass(kw_only=True)
class LoadReport:
    """What load_prompts read, dropped and kept."""

    num_rows: int = 0
    """Rows read from all files (good and bad)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Bad rows by reason (see SKIP_REASONS)."""
    num_duplicates: int = 0
    """Good rows dropped as repeats of an earlier (prompt, answer) under dedup."""
    num_kept: int = 0
    """Records returned."""
    schemas: dict[str, str] = field(default_factory=dict)
    """Detected schema per file path."""

    @property
    def num_skipped(self) -> int:
        """Bad rows over all reasons."""
        return sum(self.skipped.values())


@dataclass(frozen=True, kw_only=True)
class TokenizedPrompt:
    """A record and its prompt token ids under one template."""

    record: PromptRecord
    """The source record."""
    token_ids: list[int]
    """Prompt token ids, as given to the rollout engine."""


@dataclass(kw_only=True)
class TokenizeReport:
    """What tokenize_prompts kept and dropped."""

    num_prompts: int = 0
    """Records given."""
    num_too_long: int = 0
    """Records dropped for more than max_prompt_tokens tokens."""
    num_kept: int = 0
    """Prompts returned."""
    longest_kept: int = 0
    """Token count of the longest prompt returned."""


SKIP_REASONS = (
    "bad_json",
    "missing_prompt",
    "missing_answer",
    "empty_prompt",
    "answer_not_string",
    "bad_messages",
    "bad_data_source",
)
"""Why a row can be skipped: unparsable JSONL line, prompt / answer absent or null, prompt blank,
answer not a string (a number, list, ...), prompt not a well-formed message list with a user
message (or, plain schema, not a string), data_source not a non-empty string."""


class _BadRow(Exception):
    def __init__(self, reason: str) -> None:
        assert reason in SKIP_REASONS, reason
        self.reason = reason


def load_prompts(
    paths: str | Path | Sequence[str | Path],
    *,
    default_data_source: str = "math_dapo",
    dedup: bool = True,
    max_bad_fraction: float = 0.01,
) -> tuple[list[PromptRecord], LoadReport]:
    """Reads prompt records from parquet (``.parquet``) or JSONL (``.jsonl`` / ``.json``) files.

    ``default_data_source`` is used for rows without one (plain rows mostly). Raises
    ValueError for a file of neither schema, and when the bad rows exceed ``max_bad_fraction``
    of the rows read. One summary line is logged.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    if not default_data_source:
        raise ValueError("default_data_source must be a non-empty string, e.g. 'math_dapo'")
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if not path_list:
        raise ValueError("load_prompts needs at least one file path")

    report = LoadReport()
    skipped: Counter[str] = Counter()
    seen: set[tuple[Any, ...]] = set()
    records: list[PromptRecord] = []
    for path in path_list:
        columns, rows = _open_rows(path)
        schema = detect_schema(columns, path=path)
        report.schemas[str(path)] = schema
        for row in rows:
            index = report.num_rows
            report.num_rows += 1
            try:
                if row is None:
                    raise _BadRow("bad_json")
                record = _parse_row(row, schema, index, default_data_source)
            except _BadRow as bad:
                skipped[bad.reason] += 1
                continue
            if dedup:
                key = (record.text, record.answer, _messages_key(record.messages))
                if key in seen:
                    report.num_duplicates += 1
                    continue
                seen.add(key)
            records.append(record)

    report.skipped = dict(sorted(skipped.items()))
    report.num_kept = len(records)
    logger.info(
        "prompts: %d rows read from %d file(s), %d skipped %s, %d duplicates removed, %d kept",
        report.num_rows,
        len(path_list),
        report.num_skipped,
        report.skipped,
        report.num_duplicates,
        report.num_kept,
    )
    if report.num_rows and report.num_skipped / report.num_rows > max_bad_fraction:
        raise ValueError(
            f"{report.num_skipped} of {report.num_rows} prompt rows are unusable "
            f"({report.num_skipped / report.num_rows:.2%}; by reason: {report.skipped}), more "
            f"than max_bad_fraction={max_bad_fraction}. Fix the data, or raise max_bad_fraction "
            "(data.max_bad_fraction in a recipe) to accept the loss."
        )
    if not records:
        raise ValueError(f"no usable prompt rows in {[str(p) for p in path_list]}")
    return records, report


def detect_schema(columns: Sequence[str], *, path: str | Path = "<rows>") -> Schema:
    """'dapo' if the columns hold prompt and reward_model, 'plain' if prompt and answer."""
    names = set(columns)
    if all(c in names for c in DAPO_COLUMNS):
        return "dapo"
    if all(c in names for c in PLAIN_COLUMNS):
        return "plain"
    raise ValueError(
        f"{path}: columns {sorted(names)} match no prompt schema. Accepted: DAPO-Math-17k "
        "(data_source, prompt as a chat message list, ability, reward_model.ground_truth, "
        "extra_info) or plain (prompt: str, answer: str, optional data_source)."
    )


def tokenize_prompts(
    records: Sequence[PromptRecord],
    tokenizer: Any,
    template: str,
    max_prompt_tokens: int,
    *,
    max_bad_fraction: float = 0.01,
) -> tuple[list[TokenizedPrompt], TokenizeReport]:
    """Encodes each record with ``template`` (data/templates.py) and drops prompts over the limit.

    ``tokenizer`` is a Hugging Face tokenizer. Prompts longer than ``max_prompt_tokens`` are
    counted skips; more than ``max_bad_fraction`` of them is a ValueError.
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    report = TokenizeReport(num_prompts=len(records))
    prompts: list[TokenizedPrompt] = []
    for record in records:
        token_ids = encode_prompt(record, tokenizer, template)
        if len(token_ids) > max_prompt_tokens:
            report.num_too_long += 1
            continue
        report.longest_kept = max(report.longest_kept, len(token_ids))
        prompts.append(TokenizedPrompt(record=record, token_ids=token_ids))
    report.num_kept = len(prompts)
    logger.info(
        "prompts: %d tokenized with template %r, %d over %d tokens dropped, %d kept (longest %d)",
        report.num_prompts,
        template,
        report.num_too_long,
        max_prompt_tokens,
        report.num_kept,
        report.longest_kept,
    )
    if report.num_prompts and report.num_too_long / report.num_prompts > max_bad_fraction:
        raise ValueError(
            f"{report.num_too_long} of {report.num_prompts} prompts are longer than "
            f"max_prompt_tokens={max_prompt_tokens} under template {template!r} "
            f"({report.num_too_long / report.num_prompts:.2%} > max_bad_fraction="
            f"{max_bad_fraction}). Raise max_prompt_tokens, or max_bad_fraction to drop them."
        )
    return prompts, report


def _open_rows(path: Path) -> tuple[list[str], Iterator[dict[str, Any] | None]]:
    """The file's column names and its rows (None for a JSONL line that is not a JSON object)."""
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        parquet = pq.ParquetFile(path)
        return list(parquet.schema_arrow.names), _parquet_rows(parquet)
    if suffix in (".jsonl", ".json"):
        rows = list(_jsonl_rows(path))
        # JSONL has no schema: the columns are every key seen, so one odd first row does not decide.
        columns = sorted({key for row in rows if row is not None for key in row})
        return columns, iter(rows)
    raise ValueError(
        f"prompt file {path}: unknown extension {path.suffix!r}; use .parquet, .jsonl or .json "
        "(JSON lines)"
    )


def _parquet_rows(parquet: pq.ParquetFile) -> Iterator[dict[str, Any]]:
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        yield from batch.to_pylist()


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any] | None]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                yield None
                continue
            yield row if isinstance(row, dict) else None


def _parse_row(
    row: dict[str, Any], schema: Schema, index: int, default_data_source: str
) -> PromptRecord:
    data_source = row.get("data_source")
    if data_source is None:
        data_source = default_data_source
    if not isinstance(data_source, str) or not data_source:
        raise _BadRow("bad_data_source")

    if schema == "dapo":
        prompt = row.get("prompt")
        if prompt is None:
            raise _BadRow("missing_prompt")
        messages = _parse_messages(prompt)
        text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        reward_model = row.get("reward_model")
        answer = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        extra = dict(row.get("extra_info") or {})
        if row.get("ability") is not None:
            extra["ability"] = row["ability"]
    else:
        text = row.get("prompt")
        if text is None:
            raise _BadRow("missing_prompt")
        if not isinstance(text, str):
            raise _BadRow("bad_messages")
        messages = None
        answer = row.get("answer")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "data_source")}

    if not text.strip():
        raise _BadRow("empty_prompt")
    if answer is None:
        raise _BadRow("missing_answer")
    if not isinstance(answer, str):
        raise _BadRow("answer_not_string")
    return PromptRecord(
        index=index,
        data_source=data_source,
        messages=messages,
        text=text,
        answer=answer,
        extra=extra,
    )


def _parse_messages(prompt: Any) -> list[dict[str, str]]:
    """A list of {'role': str, 'content': str} with at least one user message, or _BadRow."""
    if not isinstance(prompt, list) or not prompt:
        raise _BadRow("bad_messages")
    messages = []
    for message in prompt:
        if not isinstance(message, dict):
            raise _BadRow("bad_messages")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _BadRow("bad_messages")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise _BadRow("bad_messages")
    return messages


def _messages_key(messages: list[dict[str, str]] | None) -> tuple[tuple[str, str], ...] | None:
    return None if messages is None else tuple((m["role"], m["content"]) for m in messages)
