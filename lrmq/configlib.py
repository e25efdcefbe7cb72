"""Typed configs: nested dataclasses built from YAML plus dotted command-line overrides.

The loader is schema-agnostic; each subsystem defines its own dataclasses, every field declared with
`opt` (a description, and for a name looked up in a registry the registry: `lrmq.config_help`).
Everything is type-checked, registered names included, and every error is collected before a single
dataclass is constructed, so a typo never half-builds a run.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import os
import pathlib
import re
import typing
from typing import Any, Literal, Sequence, TypeVar

import yaml

from lrmq import paths
from lrmq.atomic import atomic_write_text
# add_config_args and opt are part of this module's API
from lrmq.config_help import add_config_args, commented_yaml, dump_yaml, is_dataclass_type, is_union  # noqa: F401
from lrmq.config_help import bound_problem, name_problem, opt, strip_optional, suggest, to_plain, type_name  # noqa: F401

T = TypeVar("T")

_MISSING = object()


class ConfigError(ValueError):
    """A config (YAML file, dict, override, or a model's config.json) that lrmq cannot honour; the
    message names the key. The one config error class of lrmq."""


def check_data_parallel_batch(seqs: int, micro_batch: int, divisor: int, mesh: str) -> None:
    """The one mesh check of a training batch: the sequences of a step and of each micro-batch
    (`micro_batch` 0 = the whole step) must split evenly over the `divisor` data-parallel devices
    (data x fsdp) of `mesh` (how the message names the mesh)."""
    mb = micro_batch or seqs
    if seqs % divisor or mb % divisor:
        raise ConfigError(f"{seqs} sequences per step (micro-batch {mb}) do not divide over the "
                          f"{divisor} data-parallel devices of {mesh}")


# PyYAML follows YAML 1.1, where `1e-6` (no dot) is a *string*; learning rates are written exactly
# like that, so use a loader whose float rule also takes YAML 1.2 style exponents. A key given twice in one
# mapping is refused (PyYAML would keep the last one silently: a half-edited config would run).
class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first != key_node.start_mark.line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (first on line {first + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in list(_Loader.yaml_implicit_resolvers):
    _Loader.yaml_implicit_resolvers[_ch] = [
        (tag, rx) for tag, rx in _Loader.yaml_implicit_resolvers[_ch] if tag != "tag:yaml.org,2002:float"
    ]
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """YAML with the 1.2-style float rule (`1e-6` is a float)."""
    return yaml.load(text, Loader=_Loader)


def yaml_error_line(source: str, e: yaml.YAMLError) -> str:
    """One line for a YAML error: the file, the line and column, and PyYAML's problem (its message spans
    several lines, with a copy of the offending text)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{source} line {mark.line + 1} column {mark.column + 1}" if mark is not None else source
    problem = getattr(e, "problem", None) or (str(e).strip().splitlines() or ["unreadable"])[0]
    context = getattr(e, "context", None)
    return f"{where}: invalid YAML ({context + ': ' if context else ''}{problem})"


def read_yaml_file(path: str | os.PathLike, what: str = "config file") -> Any:
    """The value of a YAML file (None when it is empty); a missing file, a directory, bytes that are not UTF-8
    and invalid YAML are a ConfigError of one line naming the file (and the line)."""
    source = os.fspath(path)
    if not os.path.exists(source):
        raise ConfigError(f"{what} not found: {source}")
    try:
        text = paths.decode_utf8(paths.read_bytes(source, what), source)
    except paths.FileFormatError as e:
        raise ConfigError(str(e)) from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(source, e)) from None


# ----------------------------------------------------------------------------- type helpers


def removed_key(cls: type, key: str, full: str) -> str | None:
    """The error for a key that `cls` once had and no longer takes (a class attribute
    `REMOVED_KEYS = {"name": "why, and what to do instead"}`), or None."""
    why = getattr(cls, "REMOVED_KEYS", {}).get(key)
    return None if why is None else f"{full!r} was removed from lrmq: {why}; delete it from the config"


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception as e:  # unresolved forward reference in a user's schema
        raise ConfigError(f"cannot resolve the type annotations of {cls.__qualname__}: {e}") from e


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _value_desc(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, (dict, list)) else type(v).__name__


# ----------------------------------------------------------------------------- building


class _Builder:
    """Converts raw YAML data to typed values, collecting every error before raising."""

    def __init__(self, source: str, override_src: dict[str, str], construct: bool = True):
        self.source = source
        self.override_src = override_src  # dotted path -> the override text that set it
        self.construct = construct  # False: check-only pass, dataclasses stay dicts
        self.errors: list[str] = []

    def where(self, path: str) -> str:
        # Blame the override when the value (or one of its parents) came from the command line.
        p = path
        while p:
            if p in self.override_src:
                return f"override {self.override_src[p]!r}"
            p = p[:p.rindex("[")] if p.endswith("]") else p.rpartition(".")[0]
        return self.source

    def err(self, path: str, msg: str) -> object:
        self.errors.append(f"{self.where(path)}: {path or '<root>'}: {msg}")
        return _MISSING

    def build(self, tp: Any, v: Any, path: str) -> Any:
        if tp is Any:
            return v
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if is_union(tp):
            if v is None and type(None) in args:
                return None
            members = [a for a in args if a is not type(None)]
            if len(members) == 1:
                return self.build(members[0], v, path)
            for m in members:  # general unions: first member that accepts the value, quietly
                sub = _Builder(self.source, self.override_src, self.construct)
                out = sub.build(m, v, path)
                if not sub.errors:
                    return out
            return self.err(path, f"expected {type_name(tp)}, found {_value_desc(v)}")
        if origin is Literal:
            if any(v == a and type(v) is type(a) for a in args):
                return v
            return self.err(path, f"expected one of {list(args)}, found {v!r}")
        if is_dataclass_type(tp):
            return self.build_dataclass(tp, v, path)
        if v is None:
            return self.err(path, f"expected {type_name(tp)}, found null")
        if tp is bool:
            return v if isinstance(v, bool) else self.err(path, f"expected bool, found {_value_desc(v)}")
        if tp is int:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            return self.err(path, f"expected int, found {_value_desc(v)}")
        if tp is float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if v != v:  # NaN: never a meaningful setting, and it passes no comparison silently
                    return self.err(path, "expected a number, found nan")
                return float(v)
            return self.err(path, f"expected float, found {_value_desc(v)}")
        if tp is str:
            return v if isinstance(v, str) else self.err(path, f"expected str, found {_value_desc(v)}")
        if tp in (pathlib.Path, os.PathLike):
            return pathlib.Path(v) if isinstance(v, str) else self.err(path, f"expected a path string, found {_value_desc(v)}")
        if tp in (list, tuple) or origin in (list, tuple, collections.abc.Sequence):
            return self.build_sequence(tp, origin or tp, args, v, path)
        if tp is dict or origin in (dict, collections.abc.Mapping):
            if not isinstance(v, dict):
                return self.err(path, f"expected a mapping, found {_value_desc(v)}")
            kt, vt = args if args else (Any, Any)
            out = {}
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                key = self.build(kt, k, sub)
                val = self.build(vt, item, sub)
                out[key] = val
            return out
        if isinstance(tp, type) and isinstance(v, tp):
            return v
        return self.err(path, f"unsupported field type {type_name(tp)} (value {_value_desc(v)})")

    def build_sequence(self, tp: Any, origin: Any, args: tuple, v: Any, path: str) -> Any:
        if not isinstance(v, (list, tuple)):
            return self.err(path, f"expected a list for {type_name(tp)}, found {_value_desc(v)}")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(v) != len(args):
                return self.err(path, f"expected {len(args)} items for {type_name(tp)}, found {len(v)}")
            items = [self.build(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v))]
        else:
            et = args[0] if args else Any
            items = [self.build(et, x, f"{path}[{i}]") for i, x in enumerate(v)]
        return tuple(items) if origin is tuple else list(items)

    def build_dataclass(self, cls: type, v: Any, path: str) -> Any:
        if isinstance(v, cls):
            return v
        if not isinstance(v, dict):
            return self.err(path, f"expected a mapping for {cls.__name__}, found {_value_desc(v)}")
        hints = _hints(cls)
        fields = _init_fields(cls)
        names = [f.name for f in fields]
        ok = True
        for k in v:
            if k not in names:
                full = f"{path}.{k}" if path else str(k)
                self.err(full, removed_key(cls, k, full)
                         or f"unknown key {full!r} for {cls.__name__}{suggest(str(k), names, path + '.' if path else '')}")
                ok = False
        kwargs = {}
        for f in fields:
            full = f"{path}.{f.name}" if path else f.name
            if f.name not in v:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    self.err(full, f"missing required field {full!r} ({type_name(hints[f.name])})")
                    ok = False
                continue
            out = self.build(hints[f.name], v[f.name], full)
            if (out is _MISSING or self._has_missing(out) or not self.check_names(f, out, full)
                    or not self.check_bounds(f, out, full)):
                ok = False
            else:
                kwargs[f.name] = out
        if not ok or self.errors:
            return _MISSING
        if not self.construct:
            return kwargs
        try:
            return cls(**kwargs)
        except Exception as e:  # __post_init__ checks
            return self.err(path, f"{cls.__name__}: {e}")

    def _check_each(self, problem_of, f: dataclasses.Field, value: Any, path: str) -> bool:
        """Report `problem_of(f, x)` for the value, or for each element of a list value."""
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        good = True
        for i, x in items:
            problem = problem_of(f, x)
            if problem:
                self.err(path if i is None else f"{path}[{i}]", problem)
                good = False
        return good

    def check_names(self, f: dataclasses.Field, value: Any, path: str) -> bool:
        """A registry-backed field (`opt(names=...)`) holds registered names (each element of a list)."""
        return self._check_each(name_problem, f, value, path)

    def check_bounds(self, f: dataclasses.Field, value: Any, path: str) -> bool:
        """A bounded field (`opt(ge=..., gt=..., le=..., lt=...)`) holds numbers inside its bounds (each
        element of a list)."""
        return self._check_each(bound_problem, f, value, path)

    @staticmethod
    def _has_missing(x: Any) -> bool:
        if x is _MISSING:
            return True
        if isinstance(x, (list, tuple)):
            return any(_Builder._has_missing(i) for i in x)
        if isinstance(x, dict):
            return any(_Builder._has_missing(i) for i in x.values())
        return False


def _run_validate(obj: Any, path: str, source: str) -> None:
    """Calls `validate()` bottom-up on every dataclass in the tree (children first)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _run_validate(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name, source)
        fn = getattr(obj, "validate", None)
        if callable(fn):
            try:
                fn()
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(f"{source}: {path or '<root>'}: {type(obj).__name__}.validate: {e}") from e
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _run_validate(x, f"{path}[{i}]", source)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _run_validate(x, f"{path}.{k}" if path else str(k), source)


def _build_root(cls: type[T], data: Any, source: str, override_src: dict[str, str]) -> T:
    if not is_dataclass_type(cls):
        raise TypeError(f"config class must be a dataclass, got {cls!r}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, found {_value_desc(data)}")
    # Check everything first, construct only when the whole tree is valid.
    for construct in (False, True):
        b = _Builder(source, override_src, construct)
        out = b.build_dataclass(cls, data, "")
        if b.errors:
            break
    if b.errors:
        n = len(b.errors)
        if n == 1:  # one line
            raise ConfigError(f"config error for {cls.__name__}: {b.errors[0]}")
        raise ConfigError(f"{n} config errors for {cls.__name__}:\n  " + "\n  ".join(b.errors))
    _run_validate(out, "", source)
    return out


def config_from_dict(cls: type[T], d: dict | None, source: str = "<dict>") -> T:
    """Builds (and validates) `cls` from a plain nested dict."""
    return _build_root(cls, d, source, {})


# ----------------------------------------------------------------------------- overrides


def _field_type_at(cls: type, keys: list[str], text: str) -> Any:
    """Walks the schema along a dotted path; unknown keys fail here, before merging."""
    tp: Any = cls
    for i, k in enumerate(keys):
        dotted = ".".join(keys[: i + 1])
        inner = strip_optional(tp)
        if is_dataclass_type(inner):
            hints = _hints(inner)
            names = [f.name for f in _init_fields(inner)]
            if k not in names:
                prefix = ".".join(keys[:i]) + "." if i else ""
                if removed_key(inner, k, dotted):
                    raise ConfigError(f"override {text!r}: {removed_key(inner, k, dotted)}")
                raise ConfigError(f"override {text!r}: unknown key {dotted!r} for {inner.__name__}{suggest(k, names, prefix)}")
            tp = hints[k]
        elif inner is dict or typing.get_origin(inner) is dict:
            args = typing.get_args(inner)
            tp = args[1] if args else Any
        elif inner is Any:
            tp = Any
        else:
            raise ConfigError(f"override {text!r}: {'.'.join(keys[:i])!r} is a {type_name(inner)}, it has no key {k!r}")
    return tp


def _accepts_str_only(tp: Any) -> bool:
    tp = strip_optional(tp)
    if tp is str or tp is pathlib.Path:
        return True
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def parse_override(cls: type, text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value); the value is YAML (`1e-6`, `true`, `[1,2]`, `null`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not k for k in key.split(".")):
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    keys = key.split(".")
    tp = _field_type_at(cls, keys, text)
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({getattr(e, 'problem', None) or e})") from None
    # `name=123` or `dtype=true` for a str field means the text, not a number/bool.
    if _accepts_str_only(tp) and value is not None and not isinstance(value, str):
        value = raw.strip()
    return keys, value


def apply_overrides(cls: type, data: dict, overrides: Sequence[str]) -> tuple[dict, dict[str, str]]:
    """Merges dotted overrides into a raw (unbuilt) config dict; returns it and path -> override text."""
    data = dict(data)
    src: dict[str, str] = {}
    for text in overrides:
        keys, value = parse_override(cls, text)
        node = data
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = {}
            elif isinstance(nxt, dict):
                nxt = dict(nxt)  # copy: never mutate the caller's dict
            else:
                raise ConfigError(f"override {text!r}: {'.'.join(keys[: i + 1])!r} holds {_value_desc(nxt)}, not a mapping")
            node[k] = nxt
            node = nxt
        node[keys[-1]] = value
        src[".".join(keys)] = text
    return data, src


# ----------------------------------------------------------------------------- public API


def load_config(cls: type[T], yaml_path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Builds `cls` from a YAML file (optional) then dotted overrides; all errors before construction."""
    data: Any = {}
    source = "<defaults>"
    if yaml_path is not None:
        source = str(yaml_path)
        data = read_yaml_file(yaml_path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be a mapping, found {_value_desc(data)}")
    data, src = apply_overrides(cls, data, overrides)
    return _build_root(cls, data, source, src)


def dump_config(cfg: Any, *, comments: bool = False) -> str:
    """YAML text that `load_config` reads back to an equal config; `comments`: each field's description
    as a comment above it (`--print-config`)."""
    return commented_yaml(cfg) if comments else dump_yaml(to_plain(cfg))


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Atomic write, to a local path or a URL (gs://...): readers never see half a file."""
    atomic_write_text(path, dump_config(cfg))


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    return load_config(cls, args.config, list(args.overrides))
