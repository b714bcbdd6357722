"""The startup check of library versions: an old library is named with the version specdec needs."""

import importlib.metadata
import sys

import pytest

from worker_service.serving import compat


def test_the_installed_libraries_pass():
    compat.check_versions()


def test_an_old_library_is_named_with_the_version_needed(monkeypatch):
    installed = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "4.40.0" if name == "transformers" else installed(name)
    )
    with pytest.raises(RuntimeError, match=r"^specdec needs transformers >= 4\.56 \(found 4\.40\.0\)$"):
        compat.check_versions()


def test_a_missing_attribute_is_named(monkeypatch):
    monkeypatch.setattr(compat, "REQUIREMENTS", (("torch", "2.1", ("nn.functional.no_such_function",)),))
    with pytest.raises(RuntimeError, match=r"which has no torch\.nn\.functional\.no_such_function"):
        compat.check_versions()


def test_an_optional_library_that_does_not_import_is_left_to_its_fallback(monkeypatch):
    """Triton installed but unimportable (as on some platforms): the worker runs the PyTorch paths."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    compat.check_versions()
