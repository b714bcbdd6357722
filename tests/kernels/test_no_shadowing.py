"""Our top-level `kernels` package must not break `transformers`, which probes for HF's `kernels`."""

import subprocess
import sys


def test_transformers_loads_a_model_beside_our_kernels_package(tiny_pair):
    code = f"""
import kernels, kernels.paged_attention  # ours, imported first
import torch
import transformers
from transformers.utils.import_utils import is_kernels_available
assert kernels.__file__.startswith({str(__import__("pathlib").Path(__file__).resolve().parents[2])!r}), kernels.__file__
assert not is_kernels_available(), "transformers took our kernels package for Hugging Face's"
model = transformers.AutoModelForCausalLM.from_pretrained({str(tiny_pair.target_path)!r})
out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
assert out.shape == (1, 6)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
