"""Command-line flags generated from a config dataclass's fields: one default and one help text per setting.

A field is a flag when its metadata has "help" (`setting(default, help_text, **metadata)` makes one); the other
keys say what its annotation and default do not:

- "flag": the option, when it is not --<name with dashes> (--worker-refresh-interval for
  worker_refresh_interval_s, --kv-cache-memory-gib for kv_cache_memory_bytes);
- "metavar", "choices";
- "action": "store_true" for a switch without a --no-<flag> (a bool field is otherwise --<flag> / --no-<flag>);
- "parse": str -> value for a value an int, a float or a string does not describe; its ValueError's message
  is argparse's error (after the flag's name, which argparse writes itself);
- "unit": the field holds the flag's value (a float) times unit, as an int (GiB on the command line, bytes in
  the field);
- "flag_default": the flag's default, where it deliberately differs from the field's (what the command runs
  unless told otherwise, against what a program that builds the config gets).

An int or float field (`int | None` too) parses as one; any other field takes the string. The flag's default
is the field's (divided by its unit): no default is written twice. This module imports neither service; each
service's flags module calls it with its own config class.
"""

import argparse
from collections.abc import Callable, Iterable
import dataclasses
import functools
import types


def setting(default, help_text: str, **metadata) -> dataclasses.Field:
    """A config field that is also a flag: its default, its help text and any of the metadata keys above."""
    return dataclasses.field(default=default, metadata={"help": help_text, **metadata})


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of the config dataclass `cls` that are flags (those whose metadata has a help text)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def option(f: dataclasses.Field) -> str:
    """The field's option: metadata "flag", else --<name with dashes>."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest(f: dataclasses.Field) -> str:
    """Where argparse stores the field's flag (its option with underscores)."""
    return option(f).removeprefix("--").replace("-", "_")


def flag_default(f: dataclasses.Field):
    """The flag's default: metadata "flag_default", else the field's default (divided by its unit)."""
    if "flag_default" in f.metadata:
        return f.metadata["flag_default"]
    unit = f.metadata.get("unit")
    return f.default / unit if unit and f.default is not None else f.default


def add_flags(parser: argparse.ArgumentParser, cls, exclude: Iterable[str] = ()) -> None:
    """Adds a flag for each flag field of `cls` (in field order) except the fields named in `exclude`."""
    for f in flag_fields(cls):
        if f.name in exclude:
            continue
        if isinstance(f.type, str):
            raise TypeError(f"{cls.__name__}.{f.name}: a string annotation ({f.type!r}); flags need evaluated ones")
        kwargs = {k: f.metadata[k] for k in ("metavar", "choices") if k in f.metadata}
        if "action" in f.metadata:
            kwargs["action"] = f.metadata["action"]
        elif _base_type(f.type) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_type(f)
        parser.add_argument(option(f), default=flag_default(f), help=f.metadata["help"], **kwargs)


def values_from_args(cls, args: argparse.Namespace) -> dict:
    """The flag fields of `cls` from parsed flags, by field name (a unit's flag converted to the field's int)."""
    values = {}
    for f in flag_fields(cls):
        value, unit = getattr(args, dest(f)), f.metadata.get("unit")
        values[f.name] = int(value * unit) if unit and value is not None else value
    return values


def argv_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options `parser` defines, with their values in `args`, as a command line for a process whose
    parser defines them too: a switch as --x or --no-x, a value as --x VALUE; a None value is left out."""
    argv = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif action.nargs == 0:  # store_true and its kin: the flag alone, when it set the value
            argv += [flag] if value == action.const else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _base_type(annotation):
    """`int` of `int | None`; the annotation itself otherwise."""
    if isinstance(annotation, types.UnionType):
        kinds = [t for t in annotation.__args__ if t is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _flag_type(f: dataclasses.Field) -> Callable[[str], object] | None:
    """The argparse type of a field's flag: its "parse", a unit's float, an int or float field's; None: a string."""
    if "parse" in f.metadata:
        return _argparse_type(f.metadata["parse"], option(f))
    if "unit" in f.metadata:
        return float
    kind = _base_type(f.type)
    return kind if kind in (int, float) else None


def _argparse_type(parse: Callable[[str], object], flag: str) -> Callable[[str], object]:
    """`parse` as an argparse type: its ValueError's message becomes argparse's error, without the flag's name
    at its start (argparse writes "argument --flag: ..." itself)."""

    @functools.wraps(parse)
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from exc

    return convert
