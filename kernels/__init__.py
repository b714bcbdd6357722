"""Hot per-step kernels: Triton on an accelerator, PyTorch references on a CPU.

One module per kernel (``kernels.slot_mapping``, ``kernels.paged_attention``,
...). Each holds a ``@triton.jit`` kernel, a launcher ``*_triton``, a PyTorch
reference ``*_ref`` with the same signature, and a dispatcher that picks one.

This file must stay tiny and import nothing: ``transformers`` probes for (and
may import) a top-level package called ``kernels`` -- the Hugging Face one --
and reads its ``__version__``. Ours defines none, so the probe reports it as
unusable and moves on cheaply.
"""
