#!/usr/bin/env bash
# Generate the Python protobuf/gRPC modules for the kenspec API into kenspec_api/.
#
#   bash scripts/gen_proto.sh           # regenerate kenspec_api/generator_pb2{.py,.pyi,_grpc.py}
#   bash scripts/gen_proto.sh --check   # exit 1 if the committed modules are out of date (CI)
#
# protoc runs with `-I proto` so the descriptor registers as "kenspec/v1/generator.proto"
# (the name server reflection and grpcurl see); the output is then flattened into kenspec_api/
# and the absolute imports protoc writes are made package-relative, so the modules work from
# an installed `client` package and not only from one working directory.
# Python: $PYTHON if set, else .venv/bin/python if present, else `python`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROTO="kenspec/v1/generator.proto"
API_DIR="kenspec_api"
FILES=(generator_pb2.py generator_pb2.pyi generator_pb2_grpc.py)

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
  elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    echo "$ROOT/.venv/bin/python"
  else
    echo python
  fi
}

# generate_into DEST: write the three flat, import-fixed modules into DEST.
generate_into() {
  local dest="$1" raw="$WORK/raw"
  mkdir -p "$raw"
  "$(pick_python)" -m grpc_tools.protoc -I proto \
    --python_out="$raw" --grpc_python_out="$raw" --pyi_out="$raw" "$PROTO"
  local pkg="$raw/${PROTO%/*}"
  # The grpc module imports its messages as `from kenspec.v1 import ...`; there is no such
  # package once flattened.
  sed -e 's/^from kenspec\.v1 import generator_pb2 as /from . import generator_pb2 as /' \
    "$pkg/generator_pb2_grpc.py" >"$dest/generator_pb2_grpc.py"
  # Message classes get __module__ from this name; the real module name keeps them picklable.
  sed -e "s/BuildTopDescriptorsAndMessages(DESCRIPTOR, 'kenspec\.v1\.generator_pb2', /BuildTopDescriptorsAndMessages(DESCRIPTOR, __name__, /" \
    "$pkg/generator_pb2.py" >"$dest/generator_pb2.py"
  cp "$pkg/generator_pb2.pyi" "$dest/generator_pb2.pyi"
  if grep -q "kenspec\.v1 import\|'kenspec\.v1\.generator_pb2'" "$dest"/generator_pb2*.py; then
    echo "gen_proto.sh: import rewrite failed; protoc output format changed?" >&2
    exit 1
  fi
}

check() {
  local stale=0 f fresh="$WORK/fresh"
  mkdir "$fresh"
  generate_into "$fresh"
  for f in "${FILES[@]}"; do
    if ! cmp -s "$fresh/$f" "$API_DIR/$f"; then
      echo "gen_proto.sh: $API_DIR/$f is out of date with proto/$PROTO" >&2
      stale=1
    fi
  done
  if ((stale)); then
    echo "gen_proto.sh: run 'bash scripts/gen_proto.sh' and commit the result" >&2
    exit 1
  fi
  echo "gen_proto.sh: $API_DIR is up to date"
}

main() {
  cd "$ROOT"
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  case "${1:-}" in
    "") mkdir -p "$API_DIR"; generate_into "$API_DIR"; echo "gen_proto.sh: wrote ${FILES[*]} to $API_DIR" ;;
    --check) check ;;
    *) echo "usage: bash scripts/gen_proto.sh [--check]" >&2; exit 2 ;;
  esac
}

main "$@"
