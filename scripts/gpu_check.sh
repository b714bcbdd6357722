#!/usr/bin/env bash
# The GPU check: every GPU session runs it first (bench/gpu_check.py says what each phase measures).
#
# Here, once:   scripts/gpu_check.sh prepare
#   fills .gpu/ (git-ignored): the wheels the GPU image lacks, the Spec-Bench prompts, and the default model's
#   GGUF in three parts, each small enough to travel with the working tree in one call (64 MiB a call).
# There, in four calls on one warm machine, each carrying what it names. A carried path is gone from the working
# tree at the next call, so the script keeps the installed wheels and the parts in $GPU_CHECK_STATE (/tmp), which
# lasts as long as the machine stays warm (30 s between calls):
#   scripts/gpu_check.sh probe tier attention profile shapes invariance linears   carry .gpu/whl   (~7 min, H200)
#   scripts/gpu_check.sh probe                          carry .gpu/model/part_00 .gpu/model/SHA256SUMS
#   scripts/gpu_check.sh probe                          carry .gpu/model/part_01
#   scripts/gpu_check.sh smollm2                        carry .gpu/model/part_02 .gpu/data  (~4 min)
# The attention phase also times another revision's kernel where .gpu/paged_attention_before.py is carried in
# the first call (`git show REV:kernels/paged_attention.py > .gpu/paged_attention_before.py`; 17 KB).
# Each phase writes $OUT/gpu_check-<phase>.json; here, `.venv/bin/python bench/gpu_check.py merge DIR` joins
# the fetched files into bench/results/gpu_check.json. With every part carried, no arguments run all phases.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

if [ "${1:-}" = prepare ]; then
    set -e
    mkdir -p "$GPU/whl" "$GPU/model" "$GPU/data"
    # The image has torch, transformers, triton and pytest; these it lacks (or has too old for our protos).
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$GPU/whl" llguidance==1.9.1 gguf==0.19.0 grpcio==1.85.1 \
        grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.35.1 \
        jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 opentelemetry-api==1.45.2
    cp ../shared/data/spec_bench_dev.jsonl "$GPU/data/"
    gguf="$(.venv/bin/python -c 'from worker_service.runtime.default_model import fetch_default_gguf as f; print(f())')"
    (cd "$(dirname "$gguf")" && sha256sum "$GGUF_NAME") >"$GPU/model/SHA256SUMS"
    split -n 3 -d "$gguf" "$GPU/model/part_"
    du -sh "$GPU"/*
    exit 0
fi

OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
# What one call carried is gone from the working tree at the next, so parts and installs are kept outside it,
# for as long as the machine stays warm.
STATE="${GPU_CHECK_STATE:-/tmp/specdec-gpu-check}"
mkdir -p "$STATE/model"
echo "gpu_check: kept from earlier calls: $(ls "$STATE/model" | tr '\n' ' ')"
cp "$GPU"/model/part_0* "$GPU"/model/SHA256SUMS "$STATE/model/" 2>/dev/null
if compgen -G "$GPU/whl/*.whl" >/dev/null && [ ! -f "$STATE/site/.installed" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STATE/site" \
        "$GPU"/whl/*.whl && touch "$STATE/site/.installed"
fi
[ -d "$STATE/site" ] && export PYTHONPATH="$STATE/site${PYTHONPATH:+:$PYTHONPATH}"
export SPECDEC_CACHE_DIR="${SPECDEC_CACHE_DIR:-$STATE/cache}"
if [ ! -f "$SPECDEC_CACHE_DIR/$GGUF_NAME" ] && [ -f "$STATE/model/part_00" ] && [ -f "$STATE/model/part_02" ]; then
    mkdir -p "$SPECDEC_CACHE_DIR"
    cat "$STATE"/model/part_0* >"$SPECDEC_CACHE_DIR/$GGUF_NAME"
    if ! (cd "$SPECDEC_CACHE_DIR" && sha256sum --quiet -c "$STATE/model/SHA256SUMS"); then
        rm -f "$SPECDEC_CACHE_DIR/$GGUF_NAME"
        echo "gpu_check: the joined GGUF does not match its checksum" >&2
    fi
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv,noheader 2>/dev/null

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(probe tier attention profile shapes invariance linears smollm2)
status=0
for phase in "${phases[@]}"; do
    extra=()
    [ "$phase" = smollm2 ] && [ -f "$GPU/data/spec_bench_dev.jsonl" ] && extra=(--data "$GPU/data/spec_bench_dev.jsonl")
    echo "=== gpu_check $phase ($(date -u +%T))"
    PYTHONUNBUFFERED=1 "$PY" bench/gpu_check.py "$phase" --out "$OUT" "${extra[@]}" 2>&1 | tee -a "$OUT/gpu_check.log" |
        grep -v "^\s*$" | tail -n 40 || status=1
done
for f in "$OUT"/gpu_check-*.json; do
    [ -f "$f" ] && "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['phase'], json.dumps(d['measures']), 'errors:', json.dumps(d['errors'])[:600])" "$f"
done
exit $status
