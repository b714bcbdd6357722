"""One source per setting: each flag's default is its config field's, and `serve` forwards only real flags.

The worker's and the scheduler's flags are generated from WorkerConfig's and SchedulerOptions' fields
(specdec/config_flags.py); SchedulerOptions takes the defaults it shares with the core's SchedulerConfig from
it. These tests compare every field with the flag of the same name in each subcommand's parser, so a flag
written by hand, a copied default or a core default that drifts from the process's fails here.
"""

import argparse
import dataclasses
import os
from types import SimpleNamespace

import pytest

from scheduler_service.cluster.options import SchedulerOptions, scheduler_config
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.process import flags as scheduler_flags
from specdec import config_flags
from specdec.cli import build_parser, parsing
from worker_service.serving import flags as worker_flags
from worker_service.speculation.config import DEFAULT_PROPOSER, WorkerConfig

# What the scheduler process derives from each worker (None in its flags) where the core has a number (the core
# requires num_kv_blocks, which the process derives too).
WORKER_DERIVED = {"max_model_len", "num_speculative_tokens"}
# Flags that deliberately default to something else than their field (metadata "flag_default").
DECLARED = {"proposer"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No SPECDEC_ variable of the machine running the tests leaks into a parse."""
    for name in [n for n in os.environ if n.startswith(parsing.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def subparser(command: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[command]


def mismatched_defaults(parser: argparse.ArgumentParser, cls) -> dict[str, tuple]:
    """The fields of `cls` whose flag in `parser` (by its dest) has another default: {name: (flag's, field's)}.

    A flag with a unit (--kv-cache-memory-gib) is compared in the field's unit; a field with no default
    (WorkerConfig.model) has nothing to compare.
    """
    flag_dests = {f.name: config_flags.dest(f) for f in config_flags.flag_fields(cls)}
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    mismatches = {}
    for f in dataclasses.fields(cls):
        action = actions.get(flag_dests.get(f.name, f.name))
        if action is None or f.default is dataclasses.MISSING:
            continue
        unit = f.metadata.get("unit")
        if unit:  # the flag's float in the field's unit
            is_same = action.default * unit == f.default
        else:  # 10 is not 10.0: the help would show another default
            is_same = action.default == f.default and type(action.default) is type(f.default)
        if not is_same:
            mismatches[f.name] = (action.default, f.default)
    return mismatches


@pytest.mark.parametrize(
    "command, cls, expected",
    [
        ("worker", WorkerConfig, DECLARED),
        ("serve", WorkerConfig, DECLARED),
        ("scheduler", SchedulerOptions, set()),
        ("serve", SchedulerOptions, set()),
        ("scheduler", SchedulerConfig, WORKER_DERIVED),
        ("serve", SchedulerConfig, WORKER_DERIVED),
    ],
)
def test_every_flag_defaults_to_its_fields_default(command, cls, expected):
    assert set(mismatched_defaults(subparser(command), cls)) == expected


def test_the_declared_differences_are_the_fields_that_declare_them():
    declared = {f.name for f in dataclasses.fields(WorkerConfig) if "flag_default" in f.metadata}
    assert declared == DECLARED
    assert mismatched_defaults(subparser("worker"), WorkerConfig)["proposer"] == (DEFAULT_PROPOSER, "none")
    for name in WORKER_DERIVED | {"num_kv_blocks"}:  # None in the process: the worker's value
        assert SchedulerOptions.__dataclass_fields__[name].default is None


def test_the_cores_defaults_are_the_processes():
    """The config the process builds for a worker from no flags is the core's default but for the worker's facts."""
    assert SchedulerConfig(num_kv_blocks=8).is_async  # what production runs
    args = build_parser().parse_args(["scheduler", "--worker", "h:1"])
    options = scheduler_flags.options_from_args(args, "m", args.worker)
    info = SimpleNamespace(
        max_model_len=512,
        num_blocks_capacity=100,
        max_num_speculative_tokens=4,
        proposer="suffix",
        max_draft_tree_width=1,
        model_id="m",
        dtype="float32",
        draft_model_id="",
    )
    assert scheduler_config(options, info) == SchedulerConfig(
        num_kv_blocks=100, max_model_len=512, num_speculative_tokens=4, kv_cache_facts=("m", "float32", "suffix", "")
    )


def test_a_drifted_default_is_found(monkeypatch):
    """Teeth: the check above fails for a core default that is not the process's, and for a flag whose
    default is written by hand."""
    monkeypatch.setattr(SchedulerConfig.__dataclass_fields__["scheduling"], "default", "sync")
    drifted = mismatched_defaults(subparser("scheduler"), SchedulerConfig)
    assert set(drifted) == WORKER_DERIVED | {"scheduling"} and drifted["scheduling"] == ("async", "sync")
    parser = subparser("worker")
    next(a for a in parser._actions if a.dest == "ngram_min").default = 2
    next(a for a in parser._actions if a.dest == "kv_cache_memory_gib").default = 4.0
    assert set(mismatched_defaults(parser, WorkerConfig)) == DECLARED | {"ngram_min", "kv_cache_memory_bytes"}


def test_parsing_no_flags_gives_the_fields_defaults():
    config = worker_flags.config_from_args(build_parser().parse_args(["worker"]), "m", None)
    assert config == WorkerConfig(model="m", proposer=DEFAULT_PROPOSER)  # the one declared difference
    args = build_parser().parse_args(["scheduler", "--worker", "h:1"])
    assert scheduler_flags.options_from_args(args, "m", args.worker) == SchedulerOptions("m", ("h:1",))


# Worker flags that are not settings `serve` forwards: it sets where the worker listens, its model path
# (resolved), its share of the cores, its metrics port (one per worker), its step socket (from the scheduler's
# --step-transport) and the pipe that ends it itself; its loopback workers stay plaintext (its --ssl-* flags are
# the client port's); --log-* go before the subcommand.
NOT_FORWARDED = {
    "host",
    "port",
    "model",
    "num_threads",
    "metrics_port",
    "step_port",
    "parent_fd",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_ca_certs",
    "log_level",
    "log_format",
}


def test_serve_forwards_every_worker_setting_and_only_the_workers_flags():
    from specdec.cli.serve import _worker_argv

    serve = build_parser().parse_args(
        [
            "serve",
            "--proposer",
            "ngram",
            "--num-speculative-tokens",
            "3",
            "--ngram-min",
            "2",
            "--ngram-max",
            "5",
            "--suffix-cache-tokens",
            "7",
            "--no-forced-drafts",
            "--draft-previews",
            "--draft-tree-width",
            "2",
            "--dtype",
            "half",
            "--device",
            "cpu",
            "--max-model-len",
            "99",
            "--kv-cache-memory-gib",
            "0.5",
            "--gpu-memory-utilization",
            "0.5",
            "--draft-model",
            "d",
        ]
    )
    argv = _worker_argv(serve, "m")
    worker = build_parser().parse_args(argv)  # an unknown flag would exit here
    forwarded = {a.dest for a in subparser("worker")._actions if a.option_strings and a.dest != "help"}
    forwarded -= NOT_FORWARDED
    assert forwarded == {config_flags.dest(f) for f in config_flags.flag_fields(WorkerConfig)}
    for name in forwarded:
        assert getattr(worker, name) == getattr(serve, name), name
    config = worker_flags.config_from_args(worker, "m", None)
    assert (config.forced_drafts, config.draft_previews, config.kv_cache_memory_bytes) == (False, True, 2**29)


def test_serve_has_every_scheduler_setting():
    """`serve` builds the scheduler's options from its own flags: each one the scheduler has, same default."""
    serve_dests = {a.dest for a in subparser("serve")._actions}
    assert {config_flags.dest(f) for f in config_flags.flag_fields(SchedulerOptions)} <= serve_dests
    serve = build_parser().parse_args(["serve"])
    scheduler = build_parser().parse_args(["scheduler", "--worker", "h:1"])
    assert scheduler_flags.options_from_args(serve, "m", ["h:1"]) == scheduler_flags.options_from_args(
        scheduler, "m", ["h:1"]
    )


def _level(text: str) -> int:
    if int(text) < 0:
        raise ValueError(f"--level must be >= 0, got {text}")
    return int(text)


@dataclasses.dataclass(frozen=True)
class Toy:
    """A config class with one of each kind of flag field config_flags knows."""

    name: str
    budget_bytes: int = dataclasses.field(
        default=3 << 20, metadata={"flag": "--budget-mib", "unit": 2**20, "help": "budget"}
    )
    wait_s: float = dataclasses.field(default=1.5, metadata={"flag": "--wait", "metavar": "SECONDS", "help": "w"})
    is_loud: bool = dataclasses.field(default=False, metadata={"flag": "--loud", "action": "store_true", "help": "l"})
    is_on: bool = dataclasses.field(default=True, metadata={"flag": "--on", "help": "o"})
    level: int | None = dataclasses.field(default=None, metadata={"parse": _level, "help": "level (default: none)"})
    mode: str = dataclasses.field(default="a", metadata={"choices": ("a", "b"), "help": "m"})
    note: str = "not a flag"


def test_flags_from_a_config_class():
    parser = argparse.ArgumentParser()
    config_flags.add_flags(parser, Toy, exclude=("mode",))
    assert [a.option_strings[0] for a in parser._actions[1:]] == ["--budget-mib", "--wait", "--loud", "--on", "--level"]
    assert parser.parse_args([]).budget_mib == 3.0
    args = parser.parse_args(["--budget-mib", "0.5", "--wait", "2", "--loud", "--no-on", "--level", "4"])
    args.mode = "b"
    assert config_flags.values_from_args(Toy, args) == {
        "budget_bytes": 2**19,
        "wait_s": 2.0,
        "is_loud": True,
        "is_on": False,
        "level": 4,
        "mode": "b",
    }
    assert config_flags.argv_from_args(parser, args) == [
        "--budget-mib",
        "0.5",
        "--wait",
        "2.0",
        "--loud",
        "--no-on",
        "--level",
        "4",
    ]
    assert config_flags.argv_from_args(parser, parser.parse_args([])) == [
        "--budget-mib",
        "3.0",
        "--wait",
        "1.5",
        "--on",
    ]
    assert mismatched_defaults(parser, Toy) == {}


def test_a_parse_functions_value_error_is_the_flags_error(capsys):
    parser = argparse.ArgumentParser()
    config_flags.add_flags(parser, Toy)
    with pytest.raises(SystemExit):
        parser.parse_args(["--level", "-1"])
    assert "argument --level: must be >= 0, got -1" in capsys.readouterr().err  # argparse names the flag once
