"""Worker addresses: parsing `--worker` values and resolving dns:/// names."""

import pytest

from scheduler_service.cluster.membership import Membership, NameNotFoundError, parse_worker_spec, resolve_dns


def test_parse_worker_specs():
    assert str(parse_worker_spec("10.0.0.5:50052")) == "10.0.0.5:50052"
    spec = parse_worker_spec("dns:///specdec-worker.default.svc.cluster.local:50052")
    assert (spec.host, spec.port, spec.is_dns) == ("specdec-worker.default.svc.cluster.local", 50052, True)
    assert (parse_worker_spec("[::1]:7").host, parse_worker_spec("[::1]:7").port) == ("::1", 7)
    for bad in ("worker", "worker:", ":50052", "worker:http", "worker:0", "worker:70000", "dns:///worker"):
        with pytest.raises(ValueError, match="expected HOST:PORT or dns:///NAME:PORT"):
            parse_worker_spec(bad)


def test_static_and_dns_specs_combine_and_follow_the_resolver():
    answers = {"workers": ["10.0.0.1:50052", "10.0.0.2:50052"]}

    def resolver(name: str, port: int) -> list[str]:
        value = answers[name]
        if isinstance(value, Exception):
            raise value
        return value

    membership = Membership([parse_worker_spec("127.0.0.1:9"), parse_worker_spec("dns:///workers:50052")], resolver)
    assert membership.addresses() == ["127.0.0.1:9", "10.0.0.1:50052", "10.0.0.2:50052"]
    answers["workers"] = OSError("resolver timed out")  # cannot answer now: keep the last answer
    assert membership.addresses() == ["127.0.0.1:9", "10.0.0.1:50052", "10.0.0.2:50052"]
    answers["workers"] = ["10.0.0.2:50052", "10.0.0.3:50052"]
    assert membership.addresses() == ["127.0.0.1:9", "10.0.0.2:50052", "10.0.0.3:50052"]
    answers["workers"] = NameNotFoundError("no such name")  # scaled to zero: no workers under it ...
    assert membership.addresses() == ["127.0.0.1:9", "10.0.0.2:50052", "10.0.0.3:50052"]  # ... once it persists
    assert membership.addresses() == ["127.0.0.1:9", "10.0.0.2:50052", "10.0.0.3:50052"]
    assert membership.addresses() == ["127.0.0.1:9"]


def test_resolve_dns_on_this_machine():
    assert resolve_dns("localhost", 50052)[0].endswith(":50052")
    assert resolve_dns("127.0.0.1", 7) == ["127.0.0.1:7"]
    with pytest.raises(OSError):
        resolve_dns("name.that.does.not.exist.invalid", 1)
