"""Which workers exist: `--worker` addresses, static or found by DNS.

`HOST:PORT` names one worker. `dns:///NAME:PORT` names every address NAME
resolves to, each one worker: a Kubernetes headless Service or a compose
service with replicas. Names are resolved again every refresh interval; a
worker whose address disappears leaves (its requests move to the others).
"""

from dataclasses import dataclass
import logging
import socket
from typing import Callable

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"

# resolve(name, port) -> the addresses ("HOST:PORT") of the name; raises OSError when it cannot resolve now.
Resolver = Callable[[str, int], list[str]]


class NameNotFoundError(OSError):
    """The name does not exist (as opposed to a resolver that cannot answer now)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One `--worker` value."""

    host: str
    port: int
    is_dns: bool

    def __str__(self) -> str:
        return f"{DNS_PREFIX if self.is_dns else ''}{_join(self.host, self.port)}"


def parse_worker_spec(value: str) -> WorkerSpec:
    """Parses `HOST:PORT` or `dns:///NAME:PORT`; raises ValueError with the expected forms."""
    is_dns = value.startswith(DNS_PREFIX)
    rest = value[len(DNS_PREFIX) :] if is_dns else value
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]:50052
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address {value!r}: expected HOST:PORT or dns:///NAME:PORT")
    return WorkerSpec(host, int(port), is_dns)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_dns(name: str, port: int) -> list[str]:
    """Every address `name` resolves to, as HOST:PORT, sorted.

    IPv4 addresses only when there are any: a dual-stack name lists each host twice (A and AAAA), and two
    engines on one worker would hand out the same KV blocks.
    """
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise NameNotFoundError(f"{name}: {exc.strerror}") from exc
        raise
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return sorted({_join(info[4][0], port) for info in ipv4 or infos})


class Membership:
    """The set of worker addresses the `--worker` specs name now.

    A name that cannot be resolved for now (resolver error) keeps its last
    answer, so a flaky resolver does not take workers away; a name that does
    not exist names no worker once that was the answer NUM_NOT_FOUND_TO_EMPTY
    times in a row (a headless Service scaled to zero; one odd answer is not
    enough to move every request).
    """

    NUM_NOT_FOUND_TO_EMPTY = 3

    def __init__(self, specs: list[WorkerSpec], resolver: Resolver = resolve_dns) -> None:
        if not specs:
            raise ValueError("at least one worker address is needed (--worker)")
        self.specs = specs
        self._resolver = resolver
        self._last: dict[WorkerSpec, list[str]] = {}
        self._num_not_found: dict[WorkerSpec, int] = {}

    @property
    def has_dns(self) -> bool:
        return any(spec.is_dns for spec in self.specs)

    def addresses(self) -> list[str]:
        """The addresses of every worker the specs name now, in a stable order."""
        found: dict[str, None] = {}
        for spec in self.specs:
            if not spec.is_dns:
                found[_join(spec.host, spec.port)] = None
                continue
            try:
                self._last[spec] = self._resolver(spec.host, spec.port)
                self._num_not_found[spec] = 0
            except NameNotFoundError as exc:
                self._num_not_found[spec] = num = self._num_not_found.get(spec, 0) + 1
                if num >= self.NUM_NOT_FOUND_TO_EMPTY or spec not in self._last:
                    logger.warning("worker name %s: %s; no workers under it", spec, exc)
                    self._last[spec] = []
            except OSError as exc:
                logger.warning(
                    "cannot resolve %s now (%s); keeping its last %d addresses",
                    spec,
                    exc,
                    len(self._last.get(spec, [])),
                )
            for address in self._last.get(spec, []):
                found[address] = None
        return list(found)
