"""YAML recipes -> :class:`TrainConfig`: ``base:`` inheritance, dotted overrides, strict keys.

A recipe is a nested mapping of the config's fields. ``base: other.yaml`` (relative to the
recipe) is loaded first and the recipe's keys are merged over it, mapping by mapping, so an
ablation is a few lines. ``algorithm.preset`` names an algorithm preset whose values the
other ``algorithm`` keys override. Command-line overrides are ``dotted.key=value`` with the
value read as YAML (``trainer.steps=10``, ``policy.layout.tp=2``, ``eval.max_prompts=null``).
An unknown key is a ValueError naming the closest valid key (a removed one, ``REMOVED_KEYS``,
gets its removal's message instead); a wrong type names the field;
a negative integer names the field and what it is (every integer setting is a count, a size,
a length or a seed).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from vapo_megatron.algorithms.presets import PRESETS
from vapo_megatron.config.checks import check_gae_path
from vapo_megatron.config.train import TrainConfig

MAX_BASE_DEPTH = 8
REMOVED_KEYS: dict[str, Callable[[Any], None]] = {"trainer.gae_path": check_gae_path}
"""Settings that were removed, each with what to do with a recipe that still sets it (warn
and ignore, or refuse naming the removal). They are no fields, so no unknown-key error
offers them among the valid keys."""


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The TrainConfig of the recipe at ``path`` with ``key=value`` overrides applied."""
    data = _load_with_bases(Path(path), depth=0)
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    """Build the config from a nested mapping (strict: unknown keys are errors)."""
    data = dict(data)
    algorithm = dict(data.get("algorithm") or {})
    preset = algorithm.pop("preset", "vapo")
    if preset not in PRESETS:
        raise ValueError(
            f"algorithm.preset={preset!r} is not a preset; choose one of {sorted(PRESETS)}"
        )
    data["algorithm"] = {**PRESETS[preset], **algorithm}
    return _build(TrainConfig, data, "")


def config_to_dict(config: Any) -> Any:
    """Plain nested dicts/lists (for writing the resolved config as YAML)."""
    if dataclasses.is_dataclass(config):
        return {f.name: config_to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, dict):
        return {k: config_to_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [config_to_dict(v) for v in config]
    return config


def dump_config(config: TrainConfig, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def _load_with_bases(path: Path, depth: int) -> dict[str, Any]:
    if depth > MAX_BASE_DEPTH:
        raise ValueError(f"{path}: more than {MAX_BASE_DEPTH} nested base: recipes (a cycle?)")
    if not path.is_file():
        raise ValueError(f"recipe {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: a recipe is a mapping of config sections, got {type(data).__name__}"
        )
    base = data.pop("base", None)
    if base is None:
        return data
    merged = _load_with_bases((path.parent / base).resolve(), depth + 1)
    _merge(merged, data)
    return merged


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict) and key != "routing":
            _merge(into[key], value)
        else:
            into[key] = value


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like section.field=value")
    return key.strip(), yaml.safe_load(text) if text.strip() else ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"override {key}: {part} is a value, not a section")
        node = child
    node[last] = value


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or 'the recipe'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if _join(where, key) in REMOVED_KEYS:
            REMOVED_KEYS[_join(where, key)](value)
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {_join(where, close[0])}?" if close else ""
            raise ValueError(
                f"unknown config key {_join(where, key)}{hint} (valid keys here: "
                f"{', '.join(sorted(fields))})"
            )
        kwargs[key] = _coerce(hints[key], value, _join(where, key))
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(
            f"missing required config keys: {', '.join(_join(where, m) for m in missing)}"
        )
    _refuse_negative_integers(cls, kwargs, where)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{where or 'config'}: {err}") from None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(
            errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {hint}"
        )
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{where}={value!r} must be one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(f"{where}: config type {hint} is not supported by the recipe loader")


def _refuse_negative_integers(cls: type, kwargs: Mapping[str, Any], where: str) -> None:
    """ValueError for a negative value of an integer field of ``cls``. Every integer setting
    of the config is a count, a size, a length or a seed, where a negative value means
    nothing and would pass silently (``trainer.checkpoint_every=-3`` kept no checkpoint)."""
    for key, value in kwargs.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            path, doc = _join(where, key), field_docs(cls)[key].rstrip(".")
            raise ValueError(
                f"{path}={value}: a negative value means nothing here ({path}: {doc}); "
                "give one >= 0"
            )


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's one-line doc (the string after its annotation in the class body), first
    sentence, whitespace collapsed: how the config documents its fields."""
    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, after in zip(body, body[1:], strict=False):
        doc = getattr(after, "value", None)
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(doc, ast.Constant)
            and isinstance(doc.value, str)
        ):
            text = " ".join(doc.value.split())
            docs[node.target.id] = re.split(r"(?<=\.) ", text, maxsplit=1)[0]
    return docs


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
