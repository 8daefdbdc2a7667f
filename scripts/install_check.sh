#!/usr/bin/env bash
# What CI runs after the test suite: kenspec as a user installs it. The wheel is built from the
# repository's files (compiling the C kernels into it), installed with its dependencies into a
# fresh venv, and run with no C compiler on PATH: only `kenspec` imports (not server, client,
# ...), and the server starts on the kernels the wheel ships, with the bf16 GEMV and layer
# kernels in its plan where the CPU has avx512_bf16 or AVX2.
#
#   scripts/install_check.sh [MODEL]
#
# MODEL (or $KENSPEC_CHECK_MODEL): "default" (the default: `kenspec serve` fetches the default
# model on first use, into a fresh cache), "tiny" (a tiny random Llama built with the
# repository's .venv) or a model folder. $PYTHON (default
# python3) builds the wheel and the venv; EXTRAS (e.g. convert) installs the wheel with those
# extras; KEEP=1 keeps the work folder. Exits non-zero, with the reason, on any failure.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kenspec-install-check.XXXXXX")
SERVER_PID=""
STARTED=$SECONDS

cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  if [ "${KEEP:-0}" = 1 ]; then echo "install_check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() {
  echo "install_check: FAIL: $*" >&2
  exit 1
}
step() { echo "install_check: [$((SECONDS - STARTED))s] $*"; }

# 1. The wheel, from a copy of the repository's files (tracked and new, not ignored): no stale
#    build/ of an earlier build gets into it. The kernels must build (KENSPEC_PREBUILD=require).
step "building the wheel"
mkdir -p "$WORK/src" "$WORK/dist"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | (cd "$REPO" && tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
    | tar -xf - -C "$WORK/src"
else
  cp -a "$REPO/." "$WORK/src"
fi
KENSPEC_PREBUILD=require "$PYTHON" -m pip wheel "$WORK/src" --no-deps --quiet -w "$WORK/dist" \
  >"$WORK/wheel.log" 2>&1 || { tail -30 "$WORK/wheel.log" >&2; fail "pip wheel failed"; }
WHEELS=("$WORK"/dist/kenspec-*.whl)
[ "${#WHEELS[@]}" = 1 ] && [ -f "${WHEELS[0]}" ] || fail "expected one kenspec wheel in $WORK/dist"
WHEEL=${WHEELS[0]}
"$PYTHON" - "$WHEEL" <<'EOF' || fail "the wheel's contents (above)"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
roots = {name.split("/")[0] for name in names}
extra = {root for root in roots if root != "kenspec" and not root.endswith(".dist-info")}
assert not extra, f"top-level entries other than kenspec/: {sorted(extra)}"
prebuilt = [n for n in names if "/forward/_prebuilt/" in n]
assert any(n.endswith("/libkenspec.so") for n in prebuilt), "no prebuilt libkenspec.so"
assert any(n.endswith("/build.json") for n in prebuilt), "no build.json beside the library"
print("install_check: wheel", sys.argv[1].rsplit("/", 1)[-1], "holds", ", ".join(prebuilt))
EOF

# 2. A fresh venv with the wheel and its dependencies (from the machine's configured index).
step "installing the wheel${EXTRAS:+ with [$EXTRAS]} into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet "$WHEEL${EXTRAS:+[$EXTRAS]}" >"$WORK/install.log" 2>&1 \
  || { tail -30 "$WORK/install.log" >&2; fail "pip install of the wheel failed"; }

# 3. No C compiler from here on: PATH holds the venv's bin and a folder of the two commands
#    that may be asked for, no $CC, and a kernel cache of its own (nothing compiled lands).
mkdir -p "$WORK/bin" "$WORK/run"
for command in env sh; do ln -s "$(command -v "$command")" "$WORK/bin/$command"; done
run() {
  (cd "$WORK/run" && env -u CC PATH="$WORK/venv/bin:$WORK/bin" \
    KENSPEC_CACHE_DIR="$WORK/user-cache" KENSPEC_KERNEL_CACHE="$WORK/kernel-cache" \
    HF_HUB_OFFLINE=1 "$@")
}
run python -c "import shutil, sys; sys.exit(any(map(shutil.which, ('cc', 'gcc', 'clang'))))" \
  || fail "a C compiler is on the check's PATH"

step "checking the import names"
for name in server client kenspec_api draft_tools harness tests; do
  if run python -c "import $name" 2>/dev/null; then fail "'import $name' works: only kenspec should"; fi
done
run python -c "import kenspec.server, kenspec.client" || fail "'import kenspec.server' fails"

# 4. `kenspec serve`, until it logs "ready". MODEL "default" (the default): no --model, so the
#    first start fetches the default model into a fresh user cache, as after `pip install`, and
#    serves it with the draft the wheel ships. Else MODEL is a folder, served with --draft none.
MODEL=${1:-${KENSPEC_CHECK_MODEL:-default}}
if [ "$MODEL" = tiny ]; then
  step "building a tiny Llama"
  MODEL=$WORK/tiny-model
  (cd "$REPO" && .venv/bin/python -c \
    'import sys; from pathlib import Path; from tests import tiny
tiny.save_tiny_model(Path(sys.argv[1]), tiny.build_byte_tokenizer())' "$MODEL") \
    || fail "could not build a tiny model (needs the repository's .venv)"
fi
if [ "$MODEL" = default ]; then
  MODEL_FLAGS=()
else
  [ -d "$MODEL" ] || [ -f "$MODEL" ] || fail "no model at $MODEL"
  MODEL_FLAGS=(--model "$MODEL" --draft none)
fi
run kenspec-server --help >/dev/null || fail "the kenspec-server alias does not run"

# The gRPC port on one free port, the HTTP API and metrics off.
PORTS=(--grpc-port 0 --port -1 --metrics-port -1)
step "starting kenspec serve ${MODEL_FLAGS[*]:-(the default model, fetched on first use)}"
LOG=$WORK/server.log
(cd "$WORK/run" && exec env -u CC PATH="$WORK/venv/bin:$WORK/bin" \
  KENSPEC_CACHE_DIR="$WORK/user-cache" KENSPEC_KERNEL_CACHE="$WORK/kernel-cache" HF_HUB_OFFLINE=1 \
  kenspec serve "${MODEL_FLAGS[@]}" "${PORTS[@]}" --log-format json) >"$LOG" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + READY_TIMEOUT_S))
until grep -q '"event": *"ready"' "$LOG"; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    tail -30 "$LOG" >&2
    fail "the server exited before it was ready"
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    tail -30 "$LOG" >&2
    fail "the server was not ready within ${READY_TIMEOUT_S}s"
  fi
  sleep 1
done
step "the server is ready"

# 5. Its kernels: the wheel's; the bf16 GEMV and the layer kernels in the plan where the CPU
#    has avx512_bf16 or AVX2 (with FMA).
run python - "$LOG" <<'EOF' || { tail -30 "$LOG" >&2; fail "the kernels the server runs (above)"; }
import json, re, sys
from pathlib import Path

lines = []
for raw in Path(sys.argv[1]).read_text().splitlines():
    try:
        lines.append(json.loads(raw))
    except ValueError:
        pass
kernels = [line for line in lines if line.get("event") == "kernels"]
# One line a process; the default model's first fetch loads the model once more to check it.
assert kernels, "no 'kernels' log line"
assert all(k["source"] == kernels[0]["source"] for k in kernels), kernels
line = kernels[-1]
print("install_check: kernels:", json.dumps(line, sort_keys=True))
flags = set()
for row in Path("/proc/cpuinfo").read_text().splitlines():
    if row.startswith("flags"):
        flags = set(row.split(":", 1)[1].split())
        break
avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
avx2 = {"avx2", "fma", "f16c"} <= flags
if not avx512 and not avx2:
    assert line["source"] == "none" and line["reason"].startswith("CPU lacks AVX-512"), line
    print("install_check: neither AVX-512 nor AVX2 on this CPU: no kernels to check")
    sys.exit(0)
assert line["source"] == "prebuilt", f"the kernels are {line['source']}, not the wheel's"
assert "/_prebuilt/" in line["library"], line["library"]
plan = [l["plan"] for l in lines if l.get("event") == "execution_plan"][-1]  # the server's
print("install_check: execution_plan:", plan)
if "avx512_bf16" in flags or avx2:
    # the bf16 GEMV (AVX512-BF16's, else AVX2's) and the layer kernels in the plan
    assert ("avx512_bf16" if "avx512_bf16" in flags else "avx2") in line["isa"], line["isa"]
    assert re.search(r"\b(decoder|output) (\d+:\w+ )*\d+:gemv\b", plan), "no GEMV in the plan"
    assert "; fused;" in plan, "no layer kernels in the plan"
EOF

# 6. SIGTERM: it stops, cleanly.
step "stopping the server"
kill -TERM "$SERVER_PID"
for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
kill -0 "$SERVER_PID" 2>/dev/null && fail "the server did not stop within 30 s of SIGTERM"
status=0
wait "$SERVER_PID" || status=$?
SERVER_PID=""
[ "$status" = 0 ] || { tail -20 "$LOG" >&2; fail "the server exited $status on SIGTERM"; }
[ -e "$WORK/kernel-cache" ] && fail "kernels were compiled at start-up (into the cache)"
step "passed"
