"""Typed configuration built from plain mappings (YAML, JSON, CLI flags), validated by pydantic v2.

One source of truth: a configuration is built from defaults, then a file, then flags, in that
order, by `merge` + `build`. Nothing reads environment variables behind the user's back.
Configurations are plain dataclasses whose types pydantic checks when they are built from a
mapping (`build`); pydantic is imported only then, so `vpscluster --help` stays instant. Their
cross-field rules live in each class's `validate`, which `__post_init__` runs. Every problem
becomes ONE `UserError` line naming where the value came from, the key as a dotted path
(`strategy.sync_every`, `nodes[2].port`) and what is expected: pydantic's multi-line
`ValidationError` is turned into that line by `one_line`.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, TypeVar, Union, get_args, get_origin

from vpscluster.errors import UserError

if TYPE_CHECKING:
    from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")
MAX_FILE_BYTES = 4 << 20  # far above any real configuration or cluster file

# `__pydantic_config__` of every configuration class: unknown keys are refused (a typo must not
# be ignored), and so are NaN and infinity.
PYDANTIC_CONFIG = {"extra": "forbid", "allow_inf_nan": False}


class Before:
    """`Annotated` marker: run `fn` on the raw value before pydantic checks the type.

    Built into the schema only when pydantic builds it (no pydantic import at module load).
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self.fn, handler(source))

    def __repr__(self) -> str:
        return f"Before({self.fn.__name__})"


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads `true` as 1: `max_steps: yes` must be an error, not one step.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def shorthand(key: str) -> Before:
    """A nested section may be written as one word: `strategy: diloco` = `strategy: {name: diloco}`."""

    def expand(value: Any) -> Any:
        return {key: value} if isinstance(value, str) else value

    expand.__name__ = f"shorthand_{key}"
    return Before(expand)


Int = Annotated[int, Before(_not_bool)]
Float = Annotated[float, Before(_not_bool)]


@functools.cache
def _adapter(cls: type) -> "TypeAdapter":
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def build(cls: type[T], data: Any, where: str = "config") -> T:
    """Build configuration class `cls` from a mapping; one `UserError` line on any problem.

    Field problems are prefixed with `where` (the file, or "flags"); the cross-field rules'
    messages (from `validate`) already name their keys and stand as they are.
    """
    from pydantic import ValidationError

    try:
        return _adapter(cls).validate_python({} if data is None else data)
    except ValidationError as e:
        raise UserError(one_line(e, where, cls)) from None


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
    """Read a YAML file that must hold a non-empty mapping; one `UserError` line otherwise."""
    import yaml

    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # a model file passed by mistake is not read whole
    except OSError as e:
        raise UserError(f"{what} {p}: cannot read it ({e.strerror})") from None
    except ValueError:  # a NUL byte in the path
        raise UserError(f"{what} {show(str(p))}: not a valid file name") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{what} {p}: larger than {MAX_FILE_BYTES >> 20} MiB, not a configuration; give the YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{what} {p}: not a text file (not UTF-8); give a YAML file") from None
    if "\x00" in text:
        raise UserError(f"{what} {p}: not a text file (it holds NUL bytes); give a YAML file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{what} {p}: not valid YAML{at}; fix the syntax") from None
    except RecursionError:  # absurdly deep nesting
        raise UserError(f"{what} {p}: nested too deeply to be a configuration; fix the file") from None
    if data is None:
        raise UserError(f"{what} {p}: the file is empty; write its keys as a YAML mapping (key: value)")
    if not isinstance(data, dict):
        raise UserError(f"{what} {p}: expected a mapping at the top level (key: value), got {_kind(data)}")
    return data


# --- one line from a ValidationError ------------------------------------------------------------

_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument", "invalid_key")
_EXPECTED = {
    "int": "an integer", "float": "a number", "bool": "true or false", "string": "text",
    "list": "a list", "dict": "a mapping", "none_required": "nothing (null)",
    "finite_number": "a finite number",
}


def one_line(error: "ValidationError", where: str, root: type) -> str:
    """The first problem of `error` as one line: `where: key.path: what is expected, got X`."""
    errors = error.errors(include_url=False)
    # An unknown key first: a misspelt key is the likeliest cause of what else is wrong.
    errors.sort(key=lambda e: e.get("type") not in _UNKNOWN_KEY)
    line = _describe(errors[0], root)
    more = len(errors) - 1
    text = f"{where}: {line}" + (f" (and {more} more)" if more else "")
    return text  # UserError keeps it on one line whatever user text it quotes


def _describe(err: dict, root: type) -> str:
    loc, kind = tuple(err.get("loc", ())), err.get("type", "")
    got = err.get("input")
    if kind in _UNKNOWN_KEY:
        parent, key = loc[:-1], loc[-1] if loc else "?"
        valid = _keys(_type_at(root, parent))
        return _at(parent) + f"unknown key {show(key)}" + (f"; valid keys: {', '.join(valid)}" if valid else "")
    if kind in ("dataclass_type", "model_type", "dataclass_args_type", "model_attributes_type"):
        valid = _keys(_type_at(root, loc))
        return _at(loc) + f"expected a mapping of {', '.join(valid)}, got {_show(got)}"
    if kind == "missing":
        return _at(loc) + "missing; this key is required"
    if kind in ("value_error", "assertion_error"):
        cause = (err.get("ctx") or {}).get("error")
        return _at(loc) + (str(cause) if cause is not None else err.get("msg", "invalid value"))
    if kind == "literal_error":
        choices = (err.get("ctx") or {}).get("expected", "")
        return _at(loc) + f"{_show(got)} is not one of {choices}"
    for prefix, expected in _EXPECTED.items():
        if kind.startswith(prefix + "_") or kind == prefix:
            extra = " with no fraction" if kind == "int_from_float" else ""
            return _at(loc) + f"expected {expected}{extra}, got {_show(got)}"
    return _at(loc) + f"{err.get('msg', 'invalid value')}, got {_show(got)}"


def _at(loc: tuple) -> str:
    if not loc:
        return ""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            part = str(part)
            name = part if part.isidentifier() else show(part)
            out += ("." if out else "") + name
    return out + ": "


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return show(value)


_REPR = reprlib.Repr()  # (keyword arguments need Python 3.12)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 2, 3, 3, 3, 3
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 40


def show(value: Any) -> str:
    """A user's value for a message: short and bounded, whatever it is (YAML aliases can make a
    small file expand to a structure whose full repr would never finish)."""
    return _REPR.repr(value)


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "text", bool: "true/false", int: "a number",
            float: "a number"}.get(type(value), type(value).__name__)


def _unwrap(tp: Any) -> Any:
    """`X | None`, `Annotated[X, ...]`, `Optional[X]` -> X (the first non-None member)."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            members = [a for a in get_args(tp) if a is not type(None)]
            if not members:
                return tp
            tp = members[0]
        else:
            return tp


def _fields(tp: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(tp) if f.init}
    model_fields = getattr(tp, "model_fields", None)
    if isinstance(model_fields, dict):
        return {name: f.annotation for name, f in model_fields.items()}
    return {}


def _keys(tp: Any) -> list[str]:
    return list(_fields(tp))


def _type_at(root: type, loc: tuple) -> Any:
    """The declared type at `loc` inside `root` (for the list of valid keys), or None."""
    tp: Any = root
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(part, int) and get_origin(tp) in (list, tuple):
            args = get_args(tp)
            tp = args[0] if args else Any
        elif isinstance(part, str) and part in _fields(tp):
            tp = _fields(tp)[part]
        else:
            return None
    return _unwrap(tp)


# --- command-line flags from field metadata -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a configuration field is given on the command line: `field(metadata=flag(...))`.

    The CLI (`cli/flags.py`) builds its arguments from these; nothing is copied by hand. The
    type, choices (a `Literal`) and default come from the field itself. `help` may name
    `{default}` (the field's default, format spec allowed: `{default:g}`), `{root}` (the
    command's default configuration, e.g. `{root.warmup_steps}`) and values the command
    computes (`cli/flags.py: help_values`). `commands`: the commands that offer the flag;
    `helps`: a command's own help where it differs. `group`: the argument group it is listed
    in. `resume`: the flag may change on `train --resume`. `parse`: a function from the flag's
    text to the value (a ValueError's message is the user's error). `negatable`: a bool field
    takes --X and --no-X (None = not given); `store_false`: the flag sets the field false.
    """

    name: str
    help: str
    group: str
    metavar: str | None = None
    commands: tuple[str, ...] = ("train",)
    helps: tuple[tuple[str, str], ...] = ()
    resume: bool = False
    parse: Callable[[str], Any] | None = None
    negatable: bool = False
    store_false: bool = False

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").removeprefix("no-" if self.store_false else "").replace("-", "_")

    def help_for(self, command: str) -> str:
        return dict(self.helps).get(command, self.help)


def flag(name: str, help: str, group: str, *, helps: dict[str, str] | None = None, **kw: Any) -> dict[str, Flag]:
    """The `metadata` of a field with a command-line flag (see `Flag`)."""
    return {"flag": Flag(name, help, group, helps=tuple((helps or {}).items()), **kw)}


@dataclasses.dataclass(frozen=True)
class FlagField:
    """A flagged field found in a configuration class: its dotted key, flag, type and default."""

    key: str  # e.g. "strategy.sync_every"
    flag: Flag
    type: Any  # the declared type, `X | None` and Annotated unwrapped
    default: Any


def flag_fields(cls: type, command: str) -> list[FlagField]:
    """The fields of `cls` and its nested configuration classes with a flag `command` offers,
    in declaration order (depth first)."""
    out: list[FlagField] = []
    defaults = None  # made when needed: a class without flags may have required fields
    for name, tp in _fields(cls).items():
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        inner = _unwrap(tp)
        fl = f.metadata.get("flag")
        if fl is not None:
            if command in fl.commands:
                defaults = cls() if defaults is None else defaults
                out.append(FlagField(name, fl, inner, getattr(defaults, name)))
        elif dataclasses.is_dataclass(inner):
            out += [dataclasses.replace(sub, key=f"{name}.{sub.key}") for sub in flag_fields(inner, command)]
    return out


def comma_floats(text: str) -> list[float]:
    """`3,1` -> [3.0, 1.0] (a flag's `parse`)."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers (e.g. 3,1)") from None
