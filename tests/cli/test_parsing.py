"""The `specdec` parser: defaults in --help, --version, global flags on either side, SPECDEC_<FLAG> variables."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from scheduler_service.process import flags as scheduler_flags
from specdec.cli import build_parser, parsing
from worker_service.runtime import default_model as models
from worker_service.runtime.default_model import DEFAULT_MODEL_NAME
from worker_service.serving import flags as worker_flags
from worker_service.speculation.config import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_PROPOSER

SUBCOMMANDS = ("worker", "scheduler", "serve", "generate")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No SPECDEC_ variable of the machine running the tests leaks into a parse."""
    for name in [n for n in os.environ if n.startswith(parsing.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def help_text(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """Each option of a --help output, by its long flag: its whole entry (flags and help) on one line."""
    entries, current = {}, None
    for line in text.split("\n\n", 1)[1].splitlines():  # after the usage block
        if re.match(r"  -", line):
            current = max(re.findall(r"--?[\w-]+", line.split("  ")[1]), key=len)
            entries[current] = line.strip()
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", [(), *[(c,) for c in SUBCOMMANDS]])
def test_help_shows_a_default_for_every_flag(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    entries = option_entries(help_text(list(command), capsys))
    parser = build_parser()
    if command:
        parser = parser._subparsers._group_actions[0].choices[command[0]]
    flags = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    assert set(entries) == flags  # every option was found in the output
    for flag, entry in entries.items():
        if flag in ("--help", "--version"):
            continue
        assert re.search(r"\((default|required)\b", entry), f"{flag} shows no default: {entry}"
        assert "default: None" not in entry and "(default: )" not in entry, entry


def test_help_of_the_real_command_names_the_environment_variables():
    out = subprocess.run(
        [sys.executable, "-m", "specdec", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPECDEC_NUM_SPECULATIVE_TOKENS": "7", "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "SPECDEC_<FLAG>" in out.stdout
    entry = option_entries(out.stdout)["--num-speculative-tokens"]
    assert "(default: 7, from $SPECDEC_NUM_SPECULATIVE_TOKENS)" in entry


def test_version_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == f"specdec {importlib.metadata.version('specdec')}\n"


@pytest.mark.parametrize(
    "argv, level, log_format",
    [
        (["serve"], "INFO", "text"),
        (["--log-level", "debug", "serve"], "DEBUG", "text"),
        (["serve", "--log-level", "DEBUG", "--log-format", "json"], "DEBUG", "json"),
        (["--log-level", "ERROR", "--log-format", "json", "serve", "--log-level", "WARNING"], "WARNING", "json"),
        (["generate", "hi", "--log-format", "json"], "INFO", "json"),
    ],
)
def test_global_flags_before_or_after_the_subcommand(argv, level, log_format):
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, log_format)


def test_global_flags_from_the_environment_lose_to_the_command_line(monkeypatch):
    monkeypatch.setenv("SPECDEC_LOG_LEVEL", "warning")
    monkeypatch.setenv("SPECDEC_LOG_FORMAT", "json")
    assert build_parser().parse_args(["worker"]).log_level == "WARNING"
    args = build_parser().parse_args(["worker", "--log-level", "DEBUG"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")


def test_environment_variables_configure_the_worker_and_the_scheduler(monkeypatch):
    for name, value in {
        "SPECDEC_PROPOSER": "ngram",
        "SPECDEC_NUM_SPECULATIVE_TOKENS": "3",
        "SPECDEC_DTYPE": "half",
        "SPECDEC_KV_CACHE_MEMORY_GIB": "0.5",
        "SPECDEC_TAKE_OVER_WORKERS": "yes",
        "SPECDEC_WORKER": "10.0.0.1:50052, dns:///workers:50052",
        "SPECDEC_MAX_NUM_SEQS": "8",
    }.items():
        monkeypatch.setenv(name, value)
    worker = worker_flags.config_from_args(build_parser().parse_args(["worker"]), "m", None)
    assert (worker.proposer, worker.num_speculative_tokens, worker.dtype) == ("ngram", 3, "float16")
    assert worker.kv_cache_memory_bytes == 2**29
    args = build_parser().parse_args(["scheduler"])  # --worker is required: the variable gives it
    options = scheduler_flags.options_from_args(args, "m", args.worker)
    assert options.worker_addresses == ("10.0.0.1:50052", "dns:///workers:50052")
    assert options.take_over_workers and options.max_num_seqs == 8


def test_the_command_line_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_NUM_SPECULATIVE_TOKENS", "3")
    monkeypatch.setenv("SPECDEC_WORKER", "10.0.0.1:1,10.0.0.2:2")
    monkeypatch.setenv("SPECDEC_STOP", "a,b")
    args = build_parser().parse_args(["scheduler", "--worker", "10.0.0.3:3", "--num-speculative-tokens", "5"])
    assert args.worker == ["10.0.0.3:3"] and args.num_speculative_tokens == 5  # a list replaced, not extended
    assert build_parser().parse_args(["generate", "hi"]).stop == ["a", "b"]
    assert build_parser().parse_args(["generate", "hi", "--stop", "c", "--stop", "d"]).stop == ["c", "d"]


@pytest.mark.parametrize(
    "value, expected", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False), ("off", False)]
)
def test_switches_take_yes_and_no_words(monkeypatch, value, expected):
    monkeypatch.setenv("SPECDEC_NO_SPECULATION", value)
    assert build_parser().parse_args(["generate", "hi"]).no_speculation is expected


@pytest.mark.parametrize("value, expected", [("yes", True), ("false", False)])
def test_an_on_off_flag_takes_its_positive_name_in_the_environment(monkeypatch, value, expected):
    """--enable-prefix-caching / --no-enable-prefix-caching: SPECDEC_ENABLE_PREFIX_CACHING; the command line wins."""
    monkeypatch.setenv("SPECDEC_ENABLE_PREFIX_CACHING", value)
    assert build_parser().parse_args(["scheduler", "--worker", "h:1"]).enable_prefix_caching is expected
    argv = ["scheduler", "--worker", "h:1", "--no-enable-prefix-caching" if expected else "--enable-prefix-caching"]
    assert build_parser().parse_args(argv).enable_prefix_caching is not expected


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("SPECDEC_PORT", "abc", "environment variable SPECDEC_PORT='abc': invalid int value: 'abc'"),
        (
            "SPECDEC_PROPOSER",
            "medusa",
            "environment variable SPECDEC_PROPOSER='medusa': invalid proposer 'medusa': choose one of",
        ),
        (
            "SPECDEC_TAKE_OVER_WORKERS",
            "maybe",
            "environment variable SPECDEC_TAKE_OVER_WORKERS='maybe': expected one of",
        ),
        ("SPECDEC_LOG_LEVEL", "loud", "environment variable SPECDEC_LOG_LEVEL='loud': invalid choice"),
    ],
)
def test_a_bad_environment_value_is_a_clear_error_naming_the_variable(monkeypatch, capsys, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--worker-metrics-port", "0"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_worker_address_in_the_environment_and_other_subcommands(monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_WORKER", "no-port")
    assert build_parser().parse_args(["generate", "hi"]).prompt == "hi"  # not a flag of generate: ignored
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler"])
    assert "environment variable SPECDEC_WORKER='no-port':" in capsys.readouterr().err


def test_variables_with_a_meaning_of_their_own_are_not_flags(monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", "secret")
    assert build_parser().parse_args(["generate", "hi"]).api_key is None  # generate reads it itself, last
    environ = {"SPECDEC_API_KEY": "k", "SPECDEC_CACHE_DIR": "/models", "SPECDEC_PORT": "1", "PATH": "/bin"}
    assert parsing.flag_free_environ(environ) == {
        "SPECDEC_API_KEY": "k",
        "SPECDEC_CACHE_DIR": "/models",
        "PATH": "/bin",
    }


def test_dtype_half_is_float16():
    assert build_parser().parse_args(["serve", "--dtype", "half"]).dtype == "float16"
    assert build_parser().parse_args(["serve"]).dtype == "auto"


def test_an_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("SPECDEC_PORT", "")
    monkeypatch.setenv("SPECDEC_WORKER", " ")
    assert build_parser().parse_args(["serve"]).port == 50051
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler"])  # --worker is still required


def test_serve_passes_the_global_and_worker_flags_to_its_workers(monkeypatch):
    from specdec.cli.serve import _worker_argv

    monkeypatch.setenv("SPECDEC_DTYPE", "half")
    args = build_parser().parse_args(
        [
            "serve",
            "--log-level",
            "DEBUG",
            "--log-format",
            "json",
            "--proposer",
            "ngram",
            "--num-speculative-tokens",
            "2",
        ]
    )
    monkeypatch.delenv("SPECDEC_DTYPE")  # the worker process does not get it (flag_free_environ)
    worker = build_parser().parse_args([*_worker_argv(args, "/models/m"), "--port", "0"])
    assert (worker.command, worker.log_level, worker.log_format) == ("worker", "DEBUG", "json")
    assert (worker.dtype, worker.proposer, worker.num_speculative_tokens) == ("float16", "ngram", 2)


def test_without_flags_a_worker_speculates_with_the_default_proposer_and_its_k():
    worker = worker_flags.config_from_args(build_parser().parse_args(["worker"]), "m", None)
    assert worker.proposer == DEFAULT_PROPOSER != "none"
    assert worker.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS[DEFAULT_PROPOSER] > 0
    ngram = worker_flags.config_from_args(build_parser().parse_args(["worker", "--proposer", "ngram"]), "m", None)
    assert ngram.num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS["ngram"]  # each proposer's own k
    plain = worker_flags.config_from_args(build_parser().parse_args(["worker", "--proposer", "none"]), "m", None)
    assert (plain.proposer, plain.num_speculative_tokens) == ("none", 0)
    serve = build_parser().parse_args(["serve"])
    assert worker_flags.forwarded_argv(serve).count("--num-speculative-tokens") == 0  # the worker's default k
    assert scheduler_flags.options_from_args(serve, "m", ["127.0.0.1:1"]).num_speculative_tokens is None


@pytest.mark.parametrize(
    "model, name",
    [
        (None, DEFAULT_MODEL_NAME),
        ("/models/SmolLM2-360M", "SmolLM2-360M"),
        ("/models/llama/", "llama"),
        ("/gguf/tiny.Q8_0.gguf", "tiny.Q8_0"),
    ],
)
def test_the_served_name_is_the_models_own_name_unless_a_flag_names_it(model, name):
    assert models.model_name(model) == name
    for argv, served in ([], name), (["--served-model-name", "mine"], "mine"):
        args = build_parser().parse_args(["scheduler", "--worker", "10.0.0.1:1", *argv])
        options = scheduler_flags.options_from_args(args, "/cache/x", args.worker, models.model_name(model))
        assert options.served_model_name == served


def test_the_client_and_the_parser_start_without_the_model_libraries():
    """`specdec generate` (a client) and every subcommand's --help load neither torch nor transformers: with
    them, each start took about 10 s (train-draft's flags had imported its trainer)."""
    probe = (
        "import sys; import specdec.cli, specdec.cli.generate; specdec.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
