"""Config options described: one description per dataclass field and the registry a name field must be in,
and how configs are shown: `--help-config` (every dotted option with its type, default, description and
known names) and `--print-config` (the resolved YAML with each description as a comment).

A schema declares every field with `opt`:

    @dataclass
    class AlgoSection:
        lr: float = opt(1e-6, "peak learning rate of AdamW")
        policy_loss: str = opt("grpo", "per-token policy loss", names=POLICY_LOSSES)
        train_files: list[str] = opt(help="prompt datasets", factory=list)

`names` is a `lrmq.registry.Registry` (or a tuple / dict of names), read when a config is loaded:
`lrmq.configlib` rejects a value that is not in it (each element of a list field), collected with every
other error of the file. This module imports nothing from lrmq.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import sys
import types
import typing
from typing import Any, Iterator, Literal, Sequence, Union

import yaml

HELP, NAMES, KIND, EMPTY_OK = "help", "names", "kind", "empty_ok"  # dataclasses.Field.metadata keys
BOUNDS = "bounds"  # metadata key: {"ge"|"gt"|"le"|"lt": number}, plus "or": values allowed outside them
_OPS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b), "le": ("<=", lambda v, b: v <= b),
        "lt": ("<", lambda v, b: v < b)}


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
        names: Any = None, kind: str | None = None, empty_ok: bool = False, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None, also: tuple = ()) -> Any:
    """A dataclass field with a one-line description; `names`: the registry its value (or each element of
    its list) must be in, `kind` the word for one entry when `names` is not a Registry, `empty_ok` lets ""
    mean unset. `ge` / `gt` / `le` / `lt`: bounds of a number (each element of a list; null passes),
    checked when a config is loaded, `--print-config` included; `also`: values allowed outside them
    (e.g. `ge=1, also=(-1,)` for "-1 = all")."""
    meta = {HELP: help}
    if names is not None:
        meta.update({NAMES: names, KIND: kind, EMPTY_OK: empty_ok})
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if bounds:
        meta[BOUNDS] = dict(bounds, also=tuple(also))
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


def bounds_text(f: dataclasses.Field) -> str:
    """`>= 1`, `> 0 and <= 1`, `>= 1 or -1`: a field's bounds as --help-config and errors say them."""
    b = f.metadata.get(BOUNDS)
    if not b:
        return ""
    parts = [f"{_OPS[k][0]} {b[k]}" for k in _OPS if k in b and abs(b[k]) != float("inf")]
    if any(abs(b.get(k, 0)) == float("inf") for k in _OPS):
        parts.append("finite")
    return " and ".join(parts) + "".join(f" or {a}" for a in b.get("also", ()))


def bound_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why the number `value` is outside field `f`'s bounds (None when inside, when `f` has none, or when
    the value is not a number). NaN is never inside."""
    b = f.metadata.get(BOUNDS)
    if not b or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value in b.get("also", ()):
        return None
    if all(_OPS[k][1](value, b[k]) for k in _OPS if k in b):
        return None
    return f"must be {bounds_text(f)}, found {value!r}"


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get(HELP, "")


def known_names(f: dataclasses.Field) -> tuple[str, list[str]]:
    """(kind, names) of the registry in a field's `names`."""
    reg = f.metadata[NAMES]
    if hasattr(reg, "names"):
        return f.metadata.get(KIND) or reg.kind, reg.names()
    return f.metadata.get(KIND) or "name", sorted(reg) if isinstance(reg, dict) else list(reg)


def name_problem(f: dataclasses.Field, value: Any) -> str | None:
    """Why `value` is not a known name for field `f` (None when it is, or when `f` has no registry)."""
    if NAMES not in f.metadata or value is None or (value == "" and f.metadata.get(EMPTY_OK)):
        return None
    kind, names = known_names(f)
    if value in names:
        return None
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    return f"unknown {kind} {value!r}; known: {names}" + (f" (did you mean {close[0]!r}?)" if close else "")


# ----------------------------------------------------------------------------- type helpers


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def strip_optional(tp: Any) -> Any:
    if is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def describe_type(tp: Any) -> str:
    """`float32|bfloat16`, `int or null`, `list[str]`: how a type reads in --help-config."""
    inner = strip_optional(tp)
    if inner is not tp:
        return f"{describe_type(inner)} or null"
    if typing.get_origin(tp) is Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, dict) and args:  # list[ArmSpec], not list[lrmq.studies.config.ArmSpec]
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else describe_type(a) for a in args)}]"
    return type_name(tp)


def element_dataclass(tp: Any) -> type | None:
    """The dataclass of a `list[D]` (or `list[D] | None`) field, whose items --help-config lists; None
    for any other type."""
    inner = strip_optional(tp)
    args = typing.get_args(inner)
    if typing.get_origin(inner) is list and len(args) == 1 and is_dataclass_type(args[0]):
        return args[0]
    return None


def suggest(key: str, options: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {prefix + close[0]!r}?)"
    return f" (known keys: {sorted(options)})"


# ----------------------------------------------------------------------------- rendering


def iter_options(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, type, field) of every init field, sections before their own fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        yield prefix + f.name, hints[f.name], f
        inner = strip_optional(hints[f.name])
        if is_dataclass_type(inner):
            yield from iter_options(inner, prefix + f.name + ".")


def _flow(v: Any) -> str:
    """A value as one line of YAML, as it would be written in an override."""
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, pathlib.PurePath):
        v = str(v)
    text = yaml.safe_dump(v, default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text[:-4].rstrip() if text.endswith("\n...") else text


def options_help(cls: type) -> str:
    """The --help-config text: every option of `cls` with its type, default, description and known names;
    a list of dataclasses (a study's `arms`) is followed by the fields of each item, keyed `arms[].name`."""
    lines = [f"{cls.__name__} options: keys of the YAML file, or dotted overrides key=value (YAML values)", ""]
    _options_lines(cls, "", 0, lines)
    return "\n".join(lines) + "\n"


def _options_lines(cls: type, prefix: str, base_depth: int, lines: list[str]) -> None:
    for key, tp, f in iter_options(cls, prefix):
        depth = base_depth + key[len(prefix):].count(".")
        pad = "  " * depth
        if is_dataclass_type(strip_optional(tp)):
            lines += ([""] if depth == 0 and lines[-1] else []) + [f"{pad}{key}:  {field_help(f)}"]
            continue
        if f.default is not dataclasses.MISSING:
            default = f" = {_flow(f.default)}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f" = {_flow(f.default_factory())}"
        else:
            default = " (required)"
        rng = f"  [{bounds_text(f)}]" if BOUNDS in f.metadata else ""
        lines.append(f"{pad}{key} ({describe_type(tp)}){default}{rng}")
        lines.append(f"{pad}    {field_help(f)}")
        if NAMES in f.metadata:
            kind, names = known_names(f)
            unset = ' (or "" for none)' if f.metadata.get(EMPTY_OK) else ""
            lines.append(f"{pad}    known {kind} names: {', '.join(names)}{unset}")
        item = element_dataclass(tp)
        if item is not None:
            lines.append(f"{pad}    each item a mapping with these keys:")
            _options_lines(item, f"{key}[].", depth + 1, lines)


# ----------------------------------------------------------------------------- YAML out


def to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, paths -> str: plain YAML/JSON data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    return obj


def dump_yaml(plain: Any) -> str:
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, allow_unicode=True)


def commented_yaml(cfg: Any, plain: dict | None = None, indent: int = 0) -> str:
    """A built config as block YAML, each key preceded by its description as a comment (`--print-config`)."""
    plain = to_plain(cfg) if plain is None else plain
    out = []
    pad = " " * indent
    for f in dataclasses.fields(cfg):
        if f.name not in plain:
            continue
        if indent == 0 and out:
            out.append("")
        if field_help(f):
            out.append(f"{pad}# {field_help(f)}")
        value, data = getattr(cfg, f.name), plain[f.name]
        if dataclasses.is_dataclass(value) and isinstance(data, dict):
            out.append(f"{pad}{f.name}:")
            out.append(commented_yaml(value, data, indent + 2).rstrip("\n"))
        else:
            text = yaml.safe_dump({f.name: data}, sort_keys=False, default_flow_style=False, allow_unicode=True,
                                  width=1 << 30)
            out += [pad + line for line in text.rstrip("\n").split("\n")]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- argparse


def example_override(cls: type | None) -> str:
    """`section.key=value` for the first numeric option of a section of `cls` (a real key, so the help
    never shows one the loader rejects)."""
    if cls is not None:
        for kinds in ((float,), (int, float)):  # a float (a rate, a temperature) reads best
            for key, tp, f in iter_options(cls):
                if "." in key and strip_optional(tp) in kinds and f.default is not dataclasses.MISSING:
                    return f"{key}={_flow(f.default)}"
    return "section.key=value"


class _HelpConfigAction(argparse.Action):
    def __init__(self, option_strings, dest, config_cls=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.config_cls = config_cls

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(options_help(self.config_cls))
        parser.exit()


def add_config_args(parser: argparse.ArgumentParser, cls: type | None = None, *,
                    required: bool = False) -> argparse.ArgumentParser:
    """CLI pattern: `--config PATH [dotted.key=value ...]`; read back with `configlib.config_from_args`.

    With the schema `cls` also `--help-config` (print every option and exit) and `--print-config` (a flag
    the caller acts on, e.g. `print(dump_config(cfg, comments=True))`)."""
    parser.add_argument("--config", default=None, required=required, help="YAML config file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help=f"dotted overrides, e.g. {example_override(cls)}")
    if cls is not None:
        parser.add_argument("--help-config", action=_HelpConfigAction, config_cls=cls,
                            help="list every config option (dotted key, type, default, description) and exit")
        parser.add_argument("--print-config", action="store_true",
                            help="print the resolved config as YAML, each option's description as a comment, and exit")
    return parser
