"""Command-line flags built from the configuration classes' field metadata (`config.Flag`).

A command lists the flags of its configuration class (`train`: TrainConfig; `run`: SessionConfig
and RecoveryConfig) and gets back the map from each flag's dest to its dotted key, which turns
the flags the user gave into the nested mapping `config.build` reads. Light: no torch, no pydantic.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Literal, get_args, get_origin

from vpscluster.config import flag_fields


def help_values() -> dict[str, Any]:
    """The computed values help texts may name, besides `{default}` and `{root}`."""
    from vpscluster.launch.recovery import default_restarts
    from vpscluster.train.presets import preset_lrs_text

    return {"preset_lrs": preset_lrs_text(), "min_restarts": default_restarts(1)}


def add_flags(cls: type, command: str, groups: dict[str, Any]) -> dict[str, str]:
    """Add the flags `command` offers for `cls`'s fields to `groups` (by each flag's group name);
    return dest -> dotted key. Every flag defaults to None: "not given"."""
    root, values, keys = cls(), help_values(), {}
    for ff in flag_fields(cls, command):
        fl, tp = ff.flag, ff.type
        kw: dict[str, Any] = {"help": fl.help_for(command).format(default=ff.default, root=root, **values),
                              "default": None}
        if fl.metavar:
            kw["metavar"] = fl.metavar
        if fl.store_false:
            kw.update(action="store_false", dest=fl.dest)
        elif tp is bool:
            kw["action"] = argparse.BooleanOptionalAction if fl.negatable else "store_true"
        elif get_origin(tp) is Literal:
            kw["choices"] = get_args(tp)
        elif fl.parse is not None:
            kw["type"] = _argument_type(fl.parse)
        elif tp in (int, float):
            kw["type"] = tp
        elif tp is not str:
            raise TypeError(f"{cls.__name__}.{ff.key}: a {tp} flag needs a parse function")
        groups[fl.group].add_argument(fl.name, **kw)
        keys[fl.dest] = ff.key
    return keys


def resume_dests(cls: type, command: str) -> tuple[str, ...]:
    """The dests of the flags that may change when a run is resumed."""
    return tuple(ff.flag.dest for ff in flag_fields(cls, command) if ff.flag.resume)


def given(args: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    """dest -> value of the flags among `keys` the user gave."""
    return {dest: getattr(args, dest) for dest in keys if getattr(args, dest, None) is not None}


def nest(flat: dict[str, Any], keys: dict[str, str]) -> dict[str, Any]:
    """{dest: value} -> the nested mapping of their keys, e.g. {"strategy": {"sync_every": 8}}."""
    out: dict[str, Any] = {}
    for dest, value in flat.items():
        *parents, leaf = keys[dest].split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert
