"""Builds our C kernels (kernels/csrc) into shared libraries, once per source, compiler and CPU.

A kernel is plain C with a C ABI, called through ctypes: no Python or torch
headers, so a build takes about a second with the system C compiler (`cc`,
or `$CC`), and it happens the first time a worker needs the kernel. The
library is cached under `$SPECDEC_CACHE_DIR/kernels` (default
`~/.cache/specdec/kernels`), named by a hash of everything that makes it: the
source and the headers beside it, the flags, the compiler's version and the
CPU's instruction sets (`-march=native`), so a cache shared by different
machines never hands one a library built for another.

It links OpenMP by its soname, `libgomp.so.1`; torch's CPU wheel loads a
library of that name first, so our kernels share torch's thread pool.
"""

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess

import torch

from specdec.cache import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = pathlib.Path(__file__).parent / "csrc"
# The dtypes our C kernels take, numbered as kernels/csrc/dtypes.h numbers them.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# -ffp-contract=off: no multiply-add is fused unless the source says fmaf, so the bits of a result do not
# depend on how the compiler vectorised a loop (the batch invariance of kernels/csrc/paged_attention_cpu.c).
# -mprefer-vector-width=512 (x86): the loops the compiler vectorises take whole AVX-512 registers where the CPU
# has them (-march=native prefers 256 bits), e.g. the attention's softmax exp: a prefill of 761 tokens after 700
# 0.92x the time (docs/benchmarks.md). The same bits, since vectorising never changes an element's operations.
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
) + (("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())


class KernelBuildError(RuntimeError):
    """No C compiler, or the kernel did not compile."""


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelBuildError("no C compiler found (install gcc, or set CC)")
    return compiler


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (what -march=native builds for)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_key(source: bytes, compiler: str, flags: tuple[str, ...], source_dir: pathlib.Path) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"the C compiler {compiler} does not run: {exc}") from exc
    digest = hashlib.sha256()
    headers = b"".join(path.read_bytes() for path in sorted(source_dir.glob("*.h")))  # what the source includes
    for part in (source, headers, " ".join(flags).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def load_library(name: str, extra_cflags: tuple[str, ...] = (), source_dir: pathlib.Path = SOURCE_DIR) -> ctypes.CDLL:
    """The built library of kernels/csrc/NAME.c, compiling it first when no cached build fits.

    `extra_cflags` follow CFLAGS (tests build for a narrower instruction set with e.g. `-mno-avx512f`);
    `source_dir`: another copy of kernels/csrc (bench/bench_kernel_revisions.py builds a git revision's)."""
    source_path = source_dir / f"{name}.c"
    source = source_path.read_bytes()
    compiler = _compiler()
    flags = CFLAGS + extra_cflags
    target = cache_dir() / "kernels" / f"{name}-{_build_key(source, compiler, flags, source_dir)}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".partial-{os.getpid()}")
        logger.info("building the %s kernel with %s", name, compiler)
        result = subprocess.run(
            [compiler, *flags, "-o", str(partial), str(source_path), "-lm"], capture_output=True, text=True
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            raise KernelBuildError(f"{compiler} failed to build {source_path.name}:\n{result.stderr.strip()}")
        partial.replace(target)  # atomic: another process may build the same file meanwhile
    return ctypes.CDLL(str(target))


def optional_library(name: str, bind, instead: str) -> ctypes.CDLL | None:
    """`bind(load_library(name))` (bind declares the functions' argument types), or None where the kernel cannot
    be built or loaded here, with a warning that says what runs `instead`. Each kernel module caches its own."""
    try:
        return bind(load_library(name))
    except (KernelBuildError, OSError) as exc:
        logger.warning("the C kernels of %s are unavailable; using %s: %s", name, instead, exc)
        return None
