#!/usr/bin/env bash
# The kenspec-client distribution (packaging/kenspec-client) installs and works without torch:
#
#   1. build its wheel and check it holds kenspec/client and kenspec/api only;
#   2. install it into a fresh venv (grpcio and protobuf from the configured index) and check
#      that venv has no torch, transformers nor numpy, and no kenspec.server;
#   3. start a kenspec server from the repository's dev venv on a tiny random model;
#   4. run the fresh venv's `kenspec` against it: a one-shot generation, and `kenspec chat`
#      with one question on stdin; each must exit 0 with some output.
#
# Usage: scripts/client_install_check.sh
# Environment: PYTHON (the dev venv's python, default .venv/bin/python), CLIENT_PYTHON (the
# interpreter the fresh venv is made from, default python3, 3.11 or newer), KEEP=1 keeps the
# work folder. Exit 0 when every check passes, 1 with a message naming the one that failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
CLIENT_PYTHON="${CLIENT_PYTHON:-python3}"
PACKAGE="$REPO/packaging/kenspec-client"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/kenspec-client-check.XXXXXX")"
SERVER_PID=""
START=$(date +%s.%N)
STEP_START=""

fail() {
  echo "client_install_check: FAILED: $*" >&2
  exit 1
}

cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$PACKAGE/build" "$PACKAGE/kenspec_client.egg-info"  # what setuptools left there
  if [[ "${KEEP:-0}" == 1 ]]; then
    echo "client_install_check: work folder kept: $WORK" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

seconds_since() {  # seconds_since T0: the time since T0 (date +%s.%N), to 0.1 s
  awk -v t0="$1" -v t1="$(date +%s.%N)" 'BEGIN { printf "%.1f", t1 - t0 }'
}

step() {  # step [NAME]: end the step under way (its time), start NAME
  [[ -n "$STEP_START" ]] && echo "  ($(seconds_since "$STEP_START") s)"
  [[ $# -gt 0 ]] && echo "client_install_check: $1"
  STEP_START=$(date +%s.%N)
}

# The server, in one place (its flags change with the server's): a tiny model, gRPC on a free
# port (--grpc-port 0; the port is read from the "listening" log event), no HTTP API nor
# metrics, JSON logs to $WORK/server.log. Sets SERVER_PID and PORT.
start_server() {
  local model="$1" log="$WORK/server.log"
  (cd "$REPO" && exec "$PYTHON" -m kenspec.server --model "$model" --draft none \
    --grpc-port 0 --port -1 --metrics-port -1 --log-format json \
    --device cpu --dtype float32 --threads 1 --calibration-cache none) 2>"$log" &
  SERVER_PID=$!
  PORT=""
  for _ in $(seq 1200); do  # up to 120 s
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      tail -n 20 "$log" >&2
      fail "the server exited before it was ready (log above)"
    fi
    if ! grep -q '"ready"' "$log"; then
      sleep 0.1
      continue
    fi
    PORT=$("$PYTHON" - "$log" <<'EOF'
import json, sys
events = []
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    try:
        events.append(json.loads(line))
    except ValueError:
        pass  # not a log event (a warning of a library)
names = [e.get("event") for e in events if isinstance(e, dict)]
if "ready" in names:
    listening = next(e for e in events if e.get("event") == "listening")
    print(listening["address"].rsplit(":", 1)[1])
EOF
)
    [[ -n "$PORT" ]] && return 0
    sleep 0.1
  done
  tail -n 20 "$log" >&2
  fail "the server was not ready within 120 s (log above)"
}

[[ -x "$PYTHON" ]] || fail "no dev venv python at $PYTHON (make install, or set PYTHON)"
command -v "$CLIENT_PYTHON" >/dev/null || fail "no $CLIENT_PYTHON to make the fresh venv from"

step "building the kenspec-client wheel"
"$PYTHON" - "$REPO/pyproject.toml" "$PACKAGE/pyproject.toml" <<'EOF' || fail "version mismatch"
import sys, tomllib
server, client = (tomllib.load(open(path, "rb"))["project"]["version"] for path in sys.argv[1:])
assert client == server, f"kenspec-client is {client}, kenspec {server}: keep them equal"
print(f"  version {client}, as kenspec's")
EOF
rm -rf "$PACKAGE/build"  # setuptools would add the files an earlier build left there
"$PYTHON" -m pip wheel "$PACKAGE" --no-deps --quiet -w "$WORK/wheel" \
  || fail "pip wheel packaging/kenspec-client"
WHEEL=$(ls "$WORK"/wheel/kenspec_client-*.whl)
"$PYTHON" - "$WHEEL" <<'EOF' || fail "the wheel holds more than kenspec/client and kenspec/api"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
allowed = ("kenspec/client/", "kenspec/api/", "kenspec_client-")
other = [n for n in names if not n.startswith(allowed)]
assert not other, f"unexpected files: {other}"
for needed in ("kenspec/client/cli.py", "kenspec/api/generator_pb2.py"):
    assert needed in names, f"{needed} missing"
assert "kenspec/__init__.py" not in names  # a namespace package, shared with kenspec
print(f"  {len(names)} files: kenspec/client, kenspec/api, dist-info")
EOF

step "installing it into a fresh venv"
"$CLIENT_PYTHON" -m venv "$WORK/venv" || fail "$CLIENT_PYTHON -m venv"
VENV_PYTHON="$WORK/venv/bin/python"
"$VENV_PYTHON" -m pip install --quiet "$WHEEL" || fail "pip install the kenspec-client wheel"
INSTALLED=$("$VENV_PYTHON" -m pip list --format=freeze)
echo "$INSTALLED" | sed 's/^/  /'
for heavy in torch transformers numpy; do
  if grep -qi "^$heavy==" <<<"$INSTALLED"; then
    fail "installing kenspec-client pulled in $heavy"
  fi
done
cd "$WORK"  # not the repository: its kenspec/ must not be importable from the current folder
if "$VENV_PYTHON" -c "import kenspec.server" 2>/dev/null; then
  fail "kenspec.server imports in the client-only venv"
fi
"$VENV_PYTHON" -c "import kenspec.client, kenspec.api.generator_pb2_grpc" \
  || fail "kenspec.client does not import in the client-only venv"

step "making a tiny model with the dev venv"
(cd "$REPO" && "$PYTHON" -c "
import sys
from pathlib import Path
from tests import tiny
tiny.save_tiny_model(Path(sys.argv[1]), tiny.build_byte_tokenizer())
" "$WORK/model") || fail "building the tiny model (tests/tiny.py)"

step "starting a server on it"
start_server "$WORK/model"
echo "  listening on 127.0.0.1:$PORT (pid $SERVER_PID)"

KENSPEC="$WORK/venv/bin/kenspec"
# run_cli NAME STDIN ARGS...: the venv's kenspec with ARGS (STDIN fed to it), which must exit 0
# and print something.
run_cli() {
  local name=$1 input=$2 rc=0
  shift 2
  printf '%s' "$input" | "$KENSPEC" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" || rc=$?
  if ((rc)); then
    cat "$WORK/$name.err" >&2
    fail "kenspec $* exited with $rc"
  fi
  [[ -s "$WORK/$name.out" ]] || fail "kenspec $* printed nothing"
  echo "  stdout: $(head -c 200 "$WORK/$name.out" | tr '\n' ' ')"
  echo "  stderr: $(tail -n 1 "$WORK/$name.err")"
}

step "kenspec: one-shot generation"
run_cli generate "" --address "127.0.0.1:$PORT" "Hello" -n 8 --ignore-eos

step "kenspec chat: one question on stdin"
run_cli chat $'Hello there\n' chat --address "127.0.0.1:$PORT" -n 8 --ignore-eos

step "stopping the server"
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || fail "the server exited with $? on SIGTERM"
SERVER_PID=""

step
echo "client_install_check: OK in $(seconds_since "$START") s"
