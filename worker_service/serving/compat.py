"""The oldest libraries the worker runs with, checked once at startup.

A host may have older libraries than pyproject.toml pins (a GPU image with its
own torch). Without this check an old `transformers` fails with an ImportError
deep in the model code; with it the worker says what it needs.
"""

import importlib
import importlib.metadata

from packaging.version import Version

# (package, the oldest version with all we use, the attributes we use that older versions lack)
REQUIREMENTS = (
    ("torch", "2.1", ("nn.functional.scaled_dot_product_attention",)),  # and its scale= (2.1)
    ("transformers", "4.56", ("AttentionInterface", "PreTrainedModel.set_attn_implementation")),
    ("triton", "3.0", ("language.static_range", "language.math.div_rn")),  # optional: the GPU kernels
)
# Packages the worker runs without: one that is installed but does not import is left to its own fallback
# (kernels/_triton.py: the PyTorch paths), not refused here.
OPTIONAL = ("triton",)


def check_versions() -> None:
    """Raises RuntimeError "specdec needs transformers >= 4.56 (found 4.40.0)" for each installed package that
    is too old or lacks an attribute we use (a package that is not installed is not checked here)."""
    problems = []
    for package, oldest, attributes in REQUIREMENTS:
        try:
            found = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        is_too_old = Version(found) < Version(oldest)
        if package in OPTIONAL and not is_too_old and not _imports(package):
            continue
        missing = [] if is_too_old else [a for a in attributes if not _has_attribute(package, a)]
        if is_too_old or missing:
            lacks = f", which has no {', '.join(f'{package}.{a}' for a in missing)}" if missing else ""
            problems.append(f"specdec needs {package} >= {oldest} (found {found}{lacks})")
    if problems:
        raise RuntimeError("; ".join(problems))


def _imports(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def _has_attribute(package: str, dotted: str) -> bool:
    obj = importlib.import_module(package)
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True
