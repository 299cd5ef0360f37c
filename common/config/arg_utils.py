"""Settings written once, as dataclass fields, and turned into command-line flags from there.

A field made with `setting(...)` carries its help, choices and extra flag spellings in its metadata;
`add_dataclass_args` makes one argparse flag per field (name, type, default from the field itself) and
`dataclass_from` builds the dataclass back from the parsed namespace. A flag can then never disagree with
the setting it sets, and a new field is a new flag without touching the parser.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pagedserve.common import envs
from pagedserve.common.json_file import parse_json_object

T = TypeVar("T")

_SCALARS = (str, int, float, bool)


def setting(default: Any = None, *, help: str, choices: Sequence[str] | None = None,
            aliases: Sequence[str] = (), store_true: bool = False, env: str | None = None,
            append: bool | str = False) -> Any:
    """A dataclass field that is also a flag `--field-name`.

    choices: the allowed values (the same tuple the dataclass validates against); aliases: more spellings
    of the flag (`-tp`); store_true: a bool that is a plain switch (`--enforce-eager`) instead of
    `--x/--no-x`; env: the default is this environment variable, read when the dataclass (or the parser)
    is made, and never shown in --help (it is usually a secret); append: a tuple[str, ...] given one
    value per flag, the flag repeated (`--prompt a --prompt b`), instead of as one JSON list; append="+":
    one or more values per use as well (`--lora-modules a=x b=y`, vLLM's nargs="+").
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None,
                "aliases": tuple(aliases), "store_true": store_true, "env": env, "append": append}
    if env is not None:
        return dataclasses.field(default_factory=lambda: getattr(envs, env), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of `cls`; every field must have been made with `setting`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not a setting(): it would have no flag")
        meta = f.metadata
        default = _default(f)
        kind = _flag_type(hints[f.name], f"{cls.__name__}.{f.name}")
        flags = [f"--{f.name.replace('_', '-')}", *meta["aliases"]]
        if meta["append"]:
            if kind is not json_str_list:
                raise TypeError(f"{cls.__name__}.{f.name}: an append flag must be a tuple[str, ...]")
            action = parser.add_argument(*flags, dest=f.name, default=tuple(default), action=_AppendToTuple,
                                         choices=meta["choices"], nargs="+" if meta["append"] == "+" else None)
        elif kind is bool:
            if meta["store_true"] and default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a store_true flag must default to False")
            action = parser.add_argument(*flags, dest=f.name, default=default,
                                         action="store_true" if meta["store_true"]
                                         else argparse.BooleanOptionalAction)
        else:
            action = parser.add_argument(*flags, dest=f.name, default=default, type=kind,
                                         choices=meta["choices"])
        # Set after construction: some Python versions' BooleanOptionalAction append their own default.
        action.help = _help_text(meta, default)


class _AppendToTuple(argparse.Action):
    """Each use of the flag adds its value: the default tuple is never mutated (argparse's own "append"
    would try to, and fails on a tuple)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = values if isinstance(values, list) else [values]
        setattr(namespace, self.dest, (*getattr(namespace, self.dest), *given))


def dataclass_parser(groups: Mapping[str, type], **parser_kwargs: Any) -> argparse.ArgumentParser:
    """A parser with one argument group of flags per dataclass (e.g. {"engine": EngineArgs, "server": ...}):
    every command line of pagedserve is made this way, so the same setting is the same flag everywhere."""
    parser = argparse.ArgumentParser(**parser_kwargs)
    for title, cls in groups.items():
        add_dataclass_args(parser.add_argument_group(title), cls)
    return parser


def check_choices(obj: Any, *, as_flags: bool = False) -> None:
    """ValueError for a field whose value is not one of its setting's choices (None passes: unset). The
    choices are the ones the flag offers, so the Python API and the command line refuse the same values."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get("choices")
        if allowed is None:
            continue
        value = getattr(obj, f.name)
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and v not in allowed:
                name = f"--{f.name.replace('_', '-')}" if as_flags else f.name
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {v!r}")


def dataclass_from(ns: argparse.Namespace, cls: type[T], **overrides: Any) -> T:
    """The `cls` the parsed flags describe (ValueError from its own validation passes through)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
    return cls(**{**values, **overrides})


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise TypeError(f"setting {f.name} has no default: a flag needs one")
    return f.default


def _flag_type(hint: Any, where: str) -> Any:
    """What parses a flag's value: X for X and for X | None; a JSON list for tuple[str, ...]."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"{where}: a flag parses one type, got {hint}")
        hint = args[0]
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        return json_str_list
    if typing.get_origin(hint) is dict:
        return json_object
    if hint not in _SCALARS:
        raise TypeError(f"{where}: flags parse {', '.join(t.__name__ for t in _SCALARS)}, tuple[str, ...] or dict, "
                        f"got {hint}")
    return hint


def json_str_list(value: str) -> tuple[str, ...]:
    """A list flag's value: a JSON list of strings, as vLLM takes them (`--allowed-origins '["http://a"]'`)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"a\", \"b\"]', "
                                         f"got {value!r}")
    return tuple(items)


def json_object(value: str) -> dict[str, Any]:
    """An object flag's value: a JSON object, as vLLM takes them (`--speculative-config '{"method": "ngram"}'`)."""
    try:
        return parse_json_object(value, "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": 1}}', got {value!r}") from None


def _help_text(meta: Mapping[str, Any], default: Any) -> str:
    text = meta["help"].replace("%", "%%")       # argparse formats help with %
    if meta["env"] is not None:
        return f"{text} (default: env {meta['env']})"
    if meta["append"]:
        return f"{text} (repeatable)"
    if default is None or meta["store_true"]:
        return text                                # the help says what unset means
    if isinstance(default, tuple):
        return f"{text} (default: {json.dumps(list(default)).replace('%', '%%')})"
    return f"{text} (default: %(default)s)"
