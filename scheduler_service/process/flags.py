"""The scheduler's command-line flags, generated from SchedulerOptions' fields, and the options built from them."""

import argparse

from scheduler_service.cluster.options import SchedulerOptions
from specdec import config_flags, security

# The flags `specdec serve` leaves to its worker flags, which define them too (same names, same meaning).
MODEL_FLAG_FIELDS = ("max_model_len", "num_speculative_tokens")


def add_flags(p: argparse.ArgumentParser, with_model_flags: bool = True) -> None:
    """Adds the batching, KV, speculation-policy and worker-membership flags (SchedulerOptions' flag fields).

    with_model_flags=False leaves out --max-model-len and --num-speculative-tokens, for a launcher
    whose worker flags already define them (`specdec serve`).
    """
    config_flags.add_flags(p, SchedulerOptions, exclude=() if with_model_flags else MODEL_FLAG_FIELDS)


def add_security_flags(p: argparse.ArgumentParser, with_worker_flags: bool = True) -> None:
    """Adds TLS for the client port, the API-key file and (with_worker_flags) TLS towards the workers."""
    security.add_server_tls_flags(p, "the client API port")
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"accepted API keys, one per line (# comments); ${security.API_KEY_ENV} adds one. "
        "Clients send 'authorization: Bearer <key>' (default: no key needed)",
    )
    if not with_worker_flags:
        return
    p.add_argument(
        "--worker-ssl-certfile",
        default=None,
        metavar="PEM",
        help="the scheduler's client certificate towards the workers, with --worker-ssl-keyfile (default: none)",
    )
    p.add_argument(
        "--worker-ssl-keyfile", default=None, metavar="PEM", help="private key of --worker-ssl-certfile (default: none)"
    )
    p.add_argument(
        "--worker-ssl-ca-certs",
        default=None,
        metavar="PEM",
        help="CA that signed the workers' certificates (default: plaintext to the workers)",
    )
    p.add_argument(
        "--worker-ssl-server-name",
        default=None,
        metavar="NAME",
        help="the name the workers' certificates must carry, when the scheduler reaches them by IP "
        "(dns:/// names resolve to pod IPs) (default: the host of each worker address)",
    )


def _security_options(args: argparse.Namespace) -> dict:
    """The security fields of SchedulerOptions; reads the API-key file and $SPECDEC_API_KEY."""
    options = dict(client_tls=security.server_tls_from_args(args), api_keys=security.load_api_keys(args.api_key_file))
    if hasattr(args, "worker_ssl_ca_certs"):  # `specdec serve` keeps its loopback workers plaintext
        options.update(
            worker_tls=security.TlsFiles(
                args.worker_ssl_certfile,
                args.worker_ssl_keyfile,
                args.worker_ssl_ca_certs,
                "--worker-ssl-",
                is_server=False,
            ),
            worker_server_name=args.worker_ssl_server_name,
        )
    return options


def options_from_args(
    args: argparse.Namespace, model_dir: str, worker_addresses: list[str], model_name: str | None = None
) -> SchedulerOptions:
    """The SchedulerOptions of parsed flags; raises ValueError for bad values or an unreadable key file.

    model_name: the model's own name (its directory's or GGUF file's), served when --served-model-name is not
    given; None: the workers' model id.
    """
    values = config_flags.values_from_args(SchedulerOptions, args)
    values["served_model_name"] = values["served_model_name"] or model_name
    return SchedulerOptions(
        model_dir=model_dir,
        worker_addresses=tuple(worker_addresses),
        host=args.host,
        port=args.port,
        **values,
        **_security_options(args),
    )
