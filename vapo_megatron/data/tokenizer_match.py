"""Whether two HF directories hold the same tokenizer, read from their tokenizer files.

The critic reads the token ids the policy's tokenizer made, so a critic of its own model
(``critic.model``) must have the policy's tokenizer: the same vocabulary (token -> id), the
same BPE merges, the same added and special tokens (content, id, special flag) and the same
normalizer and pre-tokenizer (how text is split before the vocabulary applies). A matching
``vocab_size`` is not enough: two tokenizers of one size can give one id to different
strings. Roles (which special token is eos or pad), the chat template and the
``model_max_length`` are generation settings of the policy the critic never uses, so they may
differ (a reward model's eos is often the chat's end-of-turn token).

Read from ``tokenizer.json`` (fast tokenizers), else ``vocab.json`` + ``merges.txt`` +
``added_tokens.json``; ``tokenizer_config.json``'s ``added_tokens_decoder`` adds to the added
tokens. Plain JSON: no tokenizer is built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SHOWN = 5
"""Items of a difference named in the message."""


def read_tokenizer(path: str | os.PathLike) -> dict[str, Any]:
    """The parts of ``path``'s tokenizer that decide token ids: ``vocab`` {token: id},
    ``merges`` [str], ``added`` {id: (content, special)}, ``normalizer``, ``pre_tokenizer``,
    ``model`` (the tokenizer model's type). ValueError when ``path`` has no tokenizer files."""
    path = Path(path)
    fast, vocab_file = path / "tokenizer.json", path / "vocab.json"
    if fast.is_file():
        spec = json.loads(fast.read_text())
        model = spec.get("model") or {}
        parts = {
            "vocab": dict(model.get("vocab") or {}),
            "merges": [_merge(m) for m in model.get("merges") or ()],
            "added": {t["id"]: (t["content"], bool(t.get("special"))) for t in spec.get("added_tokens") or ()},
            "normalizer": spec.get("normalizer"),
            "pre_tokenizer": spec.get("pre_tokenizer"),
            "model": model.get("type"),
        }  # fmt: skip
    elif vocab_file.is_file():
        merges = path / "merges.txt"
        lines = merges.read_text().splitlines() if merges.is_file() else []
        added = path / "added_tokens.json"
        extra = json.loads(added.read_text()) if added.is_file() else {}
        parts = {
            "vocab": json.loads(vocab_file.read_text()),
            "merges": [m for m in lines if m and not m.startswith("#version")],
            "added": {i: (token, False) for token, i in extra.items()},
            "normalizer": None, "pre_tokenizer": None, "model": "BPE",
        }  # fmt: skip
    else:
        raise ValueError(
            f"{path} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt): "
            "the critic's model must come with its tokenizer to be compared with the policy's"
        )
    config = path / "tokenizer_config.json"
    decoder = (
        json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
    )
    for i, token in decoder.items():
        parts["added"].setdefault(int(i), (token["content"], bool(token.get("special"))))
    return parts


def tokenizer_differences(policy: str | os.PathLike, critic: str | os.PathLike) -> list[str]:
    """What differs between the tokenizers of two HF directories, one line per part; empty
    when they give every string the same ids."""
    a, b = read_tokenizer(policy), read_tokenizer(critic)
    out = []
    if a["model"] != b["model"]:
        out.append(f"tokenizer model: {a['model']} != {b['model']}")
    out += _dict_differences("vocabulary", a["vocab"], b["vocab"])
    if a["merges"] != b["merges"]:
        out.append(_merge_difference(a["merges"], b["merges"]))
    out += _dict_differences("added/special tokens (by id)", a["added"], b["added"])
    for part in ("normalizer", "pre_tokenizer"):
        if a[part] != b[part]:
            out.append(f"{part}: {json.dumps(a[part])} != {json.dumps(b[part])}")
    return out


def check_same_tokenizer(policy: str | os.PathLike, critic: str | os.PathLike) -> None:
    """ValueError naming every difference when the critic's model (``critic``) has another
    tokenizer than the policy's (``policy``)."""
    differ = tokenizer_differences(policy, critic)
    if differ:
        raise ValueError(
            f"the critic's model {critic} has another tokenizer than the policy's {policy}, so "
            f"it would read the policy's token ids as other text: {'; '.join(differ)}. Choose "
            "a critic.model trained with the policy's tokenizer"
        )


def _merge_difference(a: list[str], b: list[str]) -> str:
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    first = min(len(a), len(b)) if first is None else first
    rule_a = repr(a[first]) if first < len(a) else "none"
    rule_b = repr(b[first]) if first < len(b) else "none"
    return (
        f"merges ({len(a)} and {len(b)} rules): the first difference is rule {first}, "
        f"{rule_a} != {rule_b}"
    )


def _merge(rule: str | list[str]) -> str:
    return rule if isinstance(rule, str) else " ".join(rule)


def _dict_differences(what: str, a: dict, b: dict) -> list[str]:
    only_a = sorted(set(a) - set(b), key=str)
    only_b = sorted(set(b) - set(a), key=str)
    changed = sorted((k for k in set(a) & set(b) if a[k] != b[k]), key=str)
    if not (only_a or only_b or changed):
        return []
    pieces = []
    if only_a:
        pieces.append(f"{len(only_a)} only in the policy's ({_show(only_a, a)})")
    if only_b:
        pieces.append(f"{len(only_b)} only in the critic's ({_show(only_b, b)})")
    if changed:
        shown = ", ".join(f"{k!r}: {a[k]!r} != {b[k]!r}" for k in changed[:SHOWN])
        pieces.append(f"{len(changed)} differ ({shown}{', ...' if len(changed) > SHOWN else ''})")
    return [f"{what} ({len(a)} and {len(b)} entries): " + "; ".join(pieces)]


def _show(keys: list, values: dict) -> str:
    shown = ", ".join(f"{k!r}: {values[k]!r}" for k in keys[:SHOWN])
    return shown + (", ..." if len(keys) > SHOWN else "")
