"""Where specdec keeps what it fetches and builds: `$SPECDEC_CACHE_DIR`, default `~/.cache/specdec`.

The models (worker_service/runtime/default_model.py) and the built C kernels (kernels/cpu_build.py) live under it.
"""

import os
import pathlib

# In a checkpoint converted from a GGUF (worker_service/runtime/default_model.py): {"gguf": its path, "size": its
# bytes}, so a quantized dtype can serve that file's blocks (worker_service/runtime/quantization.py).
SOURCE_FILE = "specdec_source.json"


def cache_dir() -> pathlib.Path:
    """The cache directory (it may not exist yet)."""
    default = pathlib.Path.home() / ".cache" / "specdec"
    return pathlib.Path(os.environ.get("SPECDEC_CACHE_DIR", default))
