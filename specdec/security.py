"""TLS credentials and API keys, shared by both services and the clients (no service imports the other).

A server endpoint (the scheduler's client port, a worker) has a certificate
and key, and optionally a CA: with a CA, clients must present a certificate
it signed (mutual TLS). A client endpoint (the scheduler towards its workers,
`specdec generate`) has the CA that signed the server's certificate and,
for mutual TLS, its own certificate and key.

Every file is read when the credentials are built; a file that cannot be read
raises CredentialError (a ValueError) naming the flag and the path, which the
CLI prints as one line.
"""

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
import functools
import os

import grpc

API_KEY_ENV = "SPECDEC_API_KEY"


class CredentialError(ValueError):
    """A credential file is missing, unreadable or empty; the message names the flag and the path."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM file paths of one TLS endpoint. None everywhere: plaintext (an insecure port or channel).

    `flag_prefix` names the flags these came from (`--ssl-`, `--worker-ssl-`), for error messages.
    A server needs certfile + keyfile (ca_certs: require client certificates); a client needs nothing
    (ca_certs: trust this CA instead of the system roots; certfile + keyfile: present a certificate).
    """

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    flag_prefix: str = "--ssl-"
    is_server: bool = True

    def __post_init__(self) -> None:
        p = self.flag_prefix
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError(f"{p}certfile and {p}keyfile go together: give both or neither")
        if self.is_server and self.ca_certs is not None and self.certfile is None:
            raise ValueError(f"{p}ca-certs (client certificates required) needs {p}certfile and {p}keyfile")

    @property
    def is_enabled(self) -> bool:
        return any(f is not None for f in (self.certfile, self.keyfile, self.ca_certs))

    @property
    def requires_client_cert(self) -> bool:
        return self.is_server and self.ca_certs is not None


def read_file(path: str | None, flag: str) -> bytes | None:
    """The file's bytes (None for no path); CredentialError naming `flag` when unreadable or empty."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CredentialError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise CredentialError(f"{flag} {path}: the file is empty")
    return data


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials | None:
    """Credentials for add_secure_port, or None for an insecure port."""
    if not tls.is_enabled:
        return None
    p = tls.flag_prefix
    pair = (read_file(tls.keyfile, f"{p}keyfile"), read_file(tls.certfile, f"{p}certfile"))
    ca = read_file(tls.ca_certs, f"{p}ca-certs")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@functools.cache
def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials | None:
    """Credentials for grpc.secure_channel, or None for an insecure channel.

    Read once per TlsFiles: every worker channel of a scheduler shares them (a file that became unreadable
    later cannot stop a worker from joining; rotating certificates needs a restart).
    """
    if not tls.is_enabled:
        return None
    p = tls.flag_prefix
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(tls.ca_certs, f"{p}ca-certs"),
        private_key=read_file(tls.keyfile, f"{p}keyfile"),
        certificate_chain=read_file(tls.certfile, f"{p}certfile"),
    )


def channel_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options checking the server's certificate against `server_name` instead of the address.

    Needed when a server is addressed by IP (dns:/// names resolve to pod IPs) but its
    certificate names a host (e.g. the headless Service's DNS name).
    """
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def parse_api_keys(text: str) -> list[str]:
    """The keys of a key file: one per line; blank lines and `#` comments are ignored."""
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line)
    return keys


def load_api_keys(
    path: str | None, environ: Mapping[str, str] = os.environ, flag: str = "--api-key-file"
) -> frozenset[str]:
    """Every accepted key: the key file's and $SPECDEC_API_KEY's (either or both; empty: no keys)."""
    keys = set()
    if path is not None:
        data = read_file(path, flag)
        keys.update(parse_api_keys(data.decode("utf-8", errors="replace")))
        if not keys:
            raise CredentialError(f"{flag} {path}: no key in the file (only blank lines or comments)")
    if environ.get(API_KEY_ENV, "").strip():
        keys.add(environ[API_KEY_ENV].strip())
    return frozenset(keys)


def load_client_api_key(
    path: str | None, environ: Mapping[str, str] = os.environ, flag: str = "--api-key-file"
) -> str | None:
    """The one key a client sends: the key file's first key, else $SPECDEC_API_KEY, else None."""
    if path is not None:
        data = read_file(path, flag)
        keys = parse_api_keys(data.decode("utf-8", errors="replace"))
        if not keys:
            raise CredentialError(f"{flag} {path}: no key in the file (only blank lines or comments)")
        return keys[0]
    return environ.get(API_KEY_ENV, "").strip() or None


def add_server_tls_flags(p: argparse.ArgumentParser, what: str, prefix: str = "--ssl-") -> None:
    """Adds PREFIXcertfile, PREFIXkeyfile and PREFIXca-certs for the server port described by `what`."""
    p.add_argument(
        f"{prefix}certfile",
        default=None,
        metavar="PEM",
        help=f"TLS certificate (chain) of {what}; with {prefix}keyfile (default: plaintext)",
    )
    p.add_argument(
        f"{prefix}keyfile", default=None, metavar="PEM", help=f"private key of {prefix}certfile (default: none)"
    )
    p.add_argument(
        f"{prefix}ca-certs",
        default=None,
        metavar="PEM",
        help=f"CA certificates: clients of {what} must present a certificate one of them signed "
        "(mutual TLS) (default: no client certificate needed)",
    )


def server_tls_from_args(args: argparse.Namespace, prefix: str = "--ssl-") -> TlsFiles:
    """The TlsFiles of flags added by add_server_tls_flags; ValueError for a bad combination."""
    dest = prefix.strip("-").replace("-", "_")
    return TlsFiles(
        getattr(args, f"{dest}_certfile"),
        getattr(args, f"{dest}_keyfile"),
        getattr(args, f"{dest}_ca_certs"),
        flag_prefix=prefix,
    )
