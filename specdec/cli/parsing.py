"""The argparse machinery every `specdec` subcommand shares.

- DefaultsHelpFormatter: every option's help ends with its default, written
  once here rather than in each help text. A None default has no useful
  word, so those options say theirs in their help ("(default: the model's)").
- SpecdecArgumentParser: each option can also come from the environment as
  SPECDEC_<FLAG> (`--num-speculative-tokens` <- SPECDEC_NUM_SPECULATIVE_TOKENS):
  the command line wins over the variable, which wins over the default. The
  variables are read when a (sub)command's arguments are parsed, so a bad
  value only stops the subcommand that has the flag.
- add_global_flags: --log-level / --log-format, before or after the subcommand.
"""

import argparse
from collections.abc import Mapping
import importlib.metadata
import os
import textwrap

from specdec.cli.logs import LOG_FORMATS, LOG_LEVELS

ENV_PREFIX = "SPECDEC_"
# Variables that already mean something of their own (specdec/security.py,
# worker_service/runtime/default_model.py): never read as flags. `specdec generate --api-key` takes
# SPECDEC_API_KEY through security.load_client_api_key.
OWN_MEANING_ENV = frozenset({"SPECDEC_API_KEY", "SPECDEC_CACHE_DIR"})
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
ENV_EPILOG = (
    f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG> (--num-speculative-tokens: "
    f"{ENV_PREFIX}NUM_SPECULATIVE_TOKENS); the command line wins. Switches take "
    f"{'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}, repeatable flags a comma-separated list."
)


def version() -> str:
    """The installed package's version; 'unknown' when specdec runs from a source tree that is not installed."""
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def env_var(action: argparse.Action) -> str | None:
    """SPECDEC_<FLAG> for an option that can come from the environment; None for the others."""
    if not action.option_strings or action.default is argparse.SUPPRESS:
        return None  # positionals, --help, --version, and the subcommand copies of the global flags
    is_on_off = isinstance(action, argparse.BooleanOptionalAction)  # --x / --no-x: SPECDEC_X
    if action.nargs == 0 and not isinstance(action.const, bool) and not is_on_off:
        return None  # count/const actions: no switch semantics to map a variable onto
    long_option = action.option_strings[0] if is_on_off else max(action.option_strings, key=len)
    name = ENV_PREFIX + long_option.lstrip("-").upper().replace("-", "_")
    return None if name in OWN_MEANING_ENV else name


def _format_default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to each option's help, or "(default: X, from $SPECDEC_...)" when set there.

    Help that already says "(default ..." keeps its wording (options whose default is None say what None
    means there); a required option says "(required)".
    """

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)  # keep --flag-names whole

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        source = getattr(action, "env_source", None)
        if source is not None:
            text = text[: text.rfind("(default")].rstrip() if "(default" in text else text
            return f"{text} (default: {_escape(_format_default(action.default))}, from ${source})".strip()
        if "(default" in text:
            return text
        if action.required:
            return f"{text} (required)".strip()
        if action.default is None:
            return text  # the option must say in its help what None means (a test checks that every one does)
        return f"{text} (default: {_escape(_format_default(action.default))})".strip()


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings


def _parse_switch(value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    raise ValueError(f"expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")


def _convert(action: argparse.Action, text: str):
    """One value through the action's type and choices; ValueError with argparse's kind of message."""
    convert = action.type or str
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):
        raise ValueError(f"invalid {getattr(convert, '__name__', repr(convert))} value: {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"invalid choice: {text!r} (choose from {', '.join(map(str, action.choices))})")
    return value


def env_value(action: argparse.Action, text: str):
    """The option's value from its variable's text: a switch's bool, a repeatable flag's list, else one value."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return _parse_switch(text)
    if action.nargs == 0:
        return action.const if _parse_switch(text) else not action.const
    if isinstance(action, argparse._AppendAction):
        return [_convert(action, item.strip()) for item in text.split(",") if item.strip()]
    return _convert(action, text)


class SpecdecArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to their SPECDEC_<FLAG> environment variables (module docstring).

    os.environ is read at parse time: subparsers made by add_subparsers are of this class too and read it
    when their subcommand is parsed. An empty variable counts as unset (`SPECDEC_MODEL=` in a compose file).
    """

    def parse_known_args(self, args=None, namespace=None):
        from_env = self._apply_environment(os.environ)
        namespace, extras = super().parse_known_args(args, namespace)
        for action, values in from_env:
            given = getattr(namespace, action.dest, None)
            if isinstance(given, list) and len(given) > len(values):  # argparse appended to the variable's list
                setattr(namespace, action.dest, given[len(values) :])  # the command line replaces it
        return namespace, extras

    def _apply_environment(self, environ: Mapping[str, str]) -> list[tuple[argparse.Action, list]]:
        """Sets each option's default from its variable (or back to its own); returns the repeatable ones set."""
        appended = []
        for action in self._actions:
            if not hasattr(action, "own_default"):
                action.own_default, action.own_required = action.default, action.required
            action.default, action.required, action.env_source = action.own_default, action.own_required, None
            name = env_var(action)
            text = environ.get(name, "").strip() if name else ""
            if not text:
                continue
            try:
                action.default = env_value(action, text)
            except ValueError as exc:
                self.error(f"environment variable {name}={text!r}: {exc}")
            action.required, action.env_source = False, name
            if isinstance(action.default, list):
                appended.append((action, action.default))
        return appended


def add_global_flags(p: argparse.ArgumentParser, is_subcommand: bool) -> None:
    """--log-level and --log-format. On a subcommand they default to SUPPRESS, so that they only override
    the top-level value (which the environment may set) when given after the subcommand."""
    where = " (default: as given before the subcommand, else %s)"
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS if is_subcommand else "INFO",
        help="log messages of this level and above" + (where % "INFO" if is_subcommand else ""),
    )
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=argparse.SUPPRESS if is_subcommand else "text",
        help="text lines, or one JSON object per line (time, level, logger, message, exception)"
        + (where % "text" if is_subcommand else ""),
    )


def add_subcommand(sub: argparse._SubParsersAction, name: str, help_text: str, description: str | None = None):
    """A subcommand parser with the shared formatter, the environment epilog and the global flags."""
    p = sub.add_parser(
        name,
        help=help_text,
        description=description or help_text[0].upper() + help_text[1:] + ".",
        formatter_class=DefaultsHelpFormatter,
        epilog=ENV_EPILOG,
    )
    add_global_flags(p, is_subcommand=True)
    return p


def flag_free_environ(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment without SPECDEC_<FLAG> variables (those with their own meaning stay): for a child
    process that gets every setting on its command line (`specdec serve`'s workers)."""
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX) or k in OWN_MEANING_ENV}
