"""Typed configuration built from plain mappings (YAML, JSON, CLI flags), validated on build.

One source of truth: a configuration is built from defaults, then a file, then flags, in that
order, by `merge` + `build`. Nothing reads environment variables behind the user's back.
Unknown keys and wrong types raise `UserError` naming where the value came from and the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from vpscluster.errors import UserError

T = TypeVar("T")


def build(cls: type[T], data: dict[str, Any] | None, where: str = "config") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclasses."""
    data = dict(data or {})
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(fields)}")
    kwargs = {name: _coerce(hints[name], data[name], f"{where}.{name}") for name in fields if name in data}
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise UserError(f"{where}: {e}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise UserError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (item,) = get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise UserError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{where}: expected text, got {value!r}")
        return str(value)
    if tp is Path:
        return Path(str(value))
    return value


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `override` into a copy of `base` (nested mappings merge, the rest replaces)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path, what: str = "config") -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"{what} {p}: cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{what} {p}: not valid YAML{at}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{what} {p}: expected a mapping at the top level")
    return data
