#!/usr/bin/env bash
# Build KenLM's `lmplz` (ARPA estimation) and `build_binary` (ARPA -> binary) from the pinned
# kenlm sdist. The PyPI wheel only ships the query module, so the training tools come from the
# same source release.
#
# Idempotent: exits at once when both tools exist and pass a tiny train/convert smoke test.
#
# Environment:
#   KENSPEC_TOOLS_DIR    where to build and install (default: <repo>/tools); binaries land in
#                        $KENSPEC_TOOLS_DIR/kenlm/bin
#   KENSPEC_PYTHON       python whose pip downloads the sdist (default: <repo>/.venv/bin/python,
#                        else python3)
#   KENSPEC_BUILD_JOBS   parallel compile jobs (default: 2)
#   KENSPEC_KENLM_MAX_ORDER  highest n-gram order the tools support (default: 6, as the wheel)
#   KENSPEC_SKIP_APT=1   do not check or install Debian packages (you provide them)
set -euo pipefail

KENLM_VERSION=0.3.0
KENLM_SHA256=c4628bb9fb63c8a6f9240035b8b037385cfc404cb72e933cf48878291edac1e8
DEBIAN_PACKAGES=(
  cmake make g++
  libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev
  zlib1g-dev libbz2-dev liblzma-dev
)

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TOOLS_DIR=${KENSPEC_TOOLS_DIR:-$REPO_ROOT/tools}
KENLM_DIR=$TOOLS_DIR/kenlm
BIN_DIR=$KENLM_DIR/bin
JOBS=${KENSPEC_BUILD_JOBS:-2}
MAX_ORDER=${KENSPEC_KENLM_MAX_ORDER:-6}
SDIST=kenlm-$KENLM_VERSION.tar.gz

log() { echo "[build_kenlm_tools] $*"; }
die() { echo "[build_kenlm_tools] ERROR: $*" >&2; exit 1; }

default_python() {
  if [[ -n ${KENSPEC_PYTHON:-} ]]; then echo "$KENSPEC_PYTHON"
  elif [[ -x $REPO_ROOT/.venv/bin/python ]]; then echo "$REPO_ROOT/.venv/bin/python"
  else echo python3
  fi
}

# Train a bigram on three lines and binarise it: proves both tools run, link and agree.
# (`lmplz --help` is no check: it prints usage and exits 1.)
smoke_test() {
  local tmp rc=0
  tmp=$(mktemp -d)
  printf '504 2251 30\n504 2251 31\n7 504 2251 30\n' >"$tmp/corpus.txt"
  "$BIN_DIR/lmplz" -o 2 -S 64M -T "$tmp" --discount_fallback \
    <"$tmp/corpus.txt" >"$tmp/lm.arpa" 2>"$tmp/lmplz.log" || rc=$?
  if [[ $rc -eq 0 ]]; then
    "$BIN_DIR/build_binary" "$tmp/lm.arpa" "$tmp/lm.bin" >"$tmp/build_binary.log" 2>&1 || rc=$?
  fi
  if [[ $rc -eq 0 ]] && ! grep -q '^\\2-grams:' "$tmp/lm.arpa"; then rc=1; fi
  if [[ $rc -ne 0 && ${1:-} == verbose ]]; then cat "$tmp"/*.log >&2 || true; fi
  rm -rf "$tmp"
  return "$rc"
}

tools_ready() {
  [[ -x $BIN_DIR/lmplz && -x $BIN_DIR/build_binary ]] && smoke_test "$@"
}

ensure_debian_packages() {
  if [[ ${KENSPEC_SKIP_APT:-0} == 1 ]]; then
    log "KENSPEC_SKIP_APT=1: not checking Debian packages"
    return
  fi
  if ! command -v dpkg-query >/dev/null; then
    log "not a Debian system: make sure a C++ compiler, cmake and ${DEBIAN_PACKAGES[*]:3} exist"
    return
  fi
  local missing=() pkg
  for pkg in "${DEBIAN_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$pkg")
    fi
  done
  if [[ ${#missing[@]} -eq 0 ]]; then
    log "Debian build packages present"
    return
  fi
  log "installing Debian packages: ${missing[*]}"
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "need root (or sudo) to apt-get install ${missing[*]}"
    sudo=(sudo)
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# Whatever installed them (apt above, or you), fail early and plainly when a tool is missing.
check_build_commands() {
  local missing=() cmd
  for cmd in cmake make; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
  command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null ||
    missing+=("a C++ compiler")
  if [[ ${#missing[@]} -gt 0 ]]; then
    local list
    list=$(printf '%s, ' "${missing[@]}")
    die "missing ${list%, }; install them (Debian/Ubuntu: sudo apt-get install" \
      "${DEBIAN_PACKAGES[*]}; macOS: brew install cmake boost)"
  fi
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

fetch_sdist() {
  local dest=$KENLM_DIR/$SDIST
  if [[ -f $dest && $(sha256_of "$dest") == "$KENLM_SHA256" ]]; then
    log "sdist cached: $dest (sha256 ok)"
    return
  fi
  rm -f "$dest"
  local python
  python=$(default_python)
  log "downloading $SDIST with $python -m pip download"
  "$python" -m pip download --no-deps --no-binary kenlm "kenlm==$KENLM_VERSION" -d "$KENLM_DIR"
  [[ -f $dest ]] || die "pip download did not produce $dest"
  local got
  got=$(sha256_of "$dest")
  if [[ $got != "$KENLM_SHA256" ]]; then
    rm -f "$dest"
    die "sha256 mismatch for $SDIST: got $got, expected $KENLM_SHA256"
  fi
  log "sha256 ok: $KENLM_SHA256"
}

build_tools() {
  local src=$KENLM_DIR/src build=$KENLM_DIR/build
  log "extracting $SDIST into $src"
  rm -rf "$src"
  mkdir -p "$src"
  tar -xzf "$KENLM_DIR/$SDIST" -C "$src" --strip-components=1
  log "configuring (Release, KENLM_MAX_ORDER=$MAX_ORDER) in $build"
  rm -rf "$build"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKENLM_MAX_ORDER="$MAX_ORDER" \
    -DCOMPILE_TESTS=OFF -DENABLE_PYTHON=OFF -DCMAKE_CXX_FLAGS=-Wno-deprecated-declarations
  log "compiling lmplz and build_binary with -j$JOBS (niced)"
  nice -n 10 cmake --build "$build" --target lmplz build_binary -j "$JOBS"
  mkdir -p "$BIN_DIR"
  install -m 755 "$build/bin/lmplz" "$build/bin/build_binary" "$BIN_DIR/"
}

main() {
  log "tools dir: $TOOLS_DIR"
  if tools_ready; then
    log "lmplz and build_binary already built and working in $BIN_DIR; nothing to do"
    return
  fi
  local start=$SECONDS
  mkdir -p "$KENLM_DIR"
  ensure_debian_packages
  check_build_commands
  fetch_sdist
  build_tools
  tools_ready verbose || die "built tools failed the smoke test (log above)"
  log "built in $((SECONDS - start))s: $BIN_DIR/lmplz, $BIN_DIR/build_binary (smoke test passed)"
}

main "$@"
