"""The worker's command-line flags, generated from WorkerConfig's fields, and the WorkerConfig built from them."""

import argparse
import pathlib

from specdec import config_flags
from worker_service.runtime import default_model as models
from worker_service.speculation.config import WorkerConfig, proposer_names


def add_flags(p: argparse.ArgumentParser) -> None:
    """Adds the model, speculation and KV-memory flags (not --model, --host, --port or --num-threads)."""
    config_flags.add_flags(p, WorkerConfig)


def config_from_args(args: argparse.Namespace, model_dir: str, num_threads: int | None) -> WorkerConfig:
    """The WorkerConfig of parsed flags; raises ValueError for a bad combination. EAGLE-3 on the default model
    without --draft-model reads the head that ships with specdec."""
    values = config_flags.values_from_args(WorkerConfig, args)
    is_default_model = pathlib.Path(model_dir) == models.default_model_path()
    if values["draft_model"] is None and is_default_model and "eagle3" in proposer_names(values["proposer"]):
        values["draft_model"] = str(models.DEFAULT_EAGLE3_HEAD)
    return WorkerConfig(model=model_dir, num_threads=num_threads, **values)


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `args` that add_flags defines, as a worker command line (`specdec serve` to its workers)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_flags(parser)
    return config_flags.argv_from_args(parser, args)
