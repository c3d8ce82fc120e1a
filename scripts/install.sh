#!/usr/bin/env bash
# Idempotent install of tokenaug and its upstream stack into a venv inside the repo.
#
#   bash scripts/install.sh [VENV]        (default: .venv; called by `make install`)
#
# Steps (each skipped when already satisfied; a stamp file makes a second call a no-op):
#   1. python3.11 venv
#   2. torch 2.14.1 + torchvision 0.29.1 (pip takes them from this machine's local wheel index)
#   3. setuptools<81 (mmcv's setup.py and mmengine's `pkg::` config lookup import pkg_resources) + ninja
#   4. mmcv 2.1.0 with CPU ops, built from its PyPI sdist. torch >= 2.10 headers need C++20 and
#      mmcv 2.1.0's setup.py hard-codes -std=c++17, so the sdist is patched. The wheel is built once
#      into a cache outside the repo ($TOKENAUG_WHEEL_CACHE, default ~/.cache/tokenaug/wheels):
#      pip does not cache wheels built from a local folder, and the build takes ~12 min on 2 cores.
#   5. tokenaug itself (editable) with timm, mmengine, mmpretrain, mmsegmentation, mmdet, ftfy, regex
#      and the test tools, everything pinned by constraints.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv}
CONS=$ROOT/constraints.txt
CACHE=${TOKENAUG_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenaug/wheels}
LOG=$ROOT/install-logs
PY=${PYTHON:-python3.11}
STAMP=$VENV/.tokenaug-installed
want=$(cat "$CONS" "$ROOT/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "install: $VENV is up to date"
  exit 0
fi
mkdir -p "$LOG" "$CACHE"
step() {
  local name=$1; shift; local s; s=$(date +%s); echo ">>> install: $name"
  "$@" >"$LOG/$name.log" 2>&1 || { echo "FAILED: $name (log: $LOG/$name.log)"; tail -40 "$LOG/$name.log"; exit 1; }
  echo "    ok in $(( $(date +%s) - s ))s"
}

[ -x "$VENV/bin/python" ] || step 01-venv "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
step 02-torch "${PIP[@]}" install -c "$CONS" torch==2.14.1 torchvision==0.29.1
step 03-buildtools "${PIP[@]}" install -c "$CONS" "setuptools<81" ninja wheel

build_mmcv() {
  local src; src=$(mktemp -d)
  "${PIP[@]}" download -c "$CONS" --no-deps --no-binary :all: --no-build-isolation mmcv==2.1.0 -d "$src"
  tar -xzf "$src/mmcv-2.1.0.tar.gz" -C "$src"
  sed -i 's/-std=c++17/-std=c++20/g' "$src/mmcv-2.1.0/setup.py"
  grep -q -- '-std=c++20' "$src/mmcv-2.1.0/setup.py"
  # CPU ops: FORCE_CUDA unset and no GPU visible -> CppExtension of pytorch/*.cpp + pytorch/cpu/*.cpp
  env -u FORCE_CUDA MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" CFLAGS="-O3 -DNDEBUG -fwrapv -g0" \
    "${PIP[@]}" wheel -v --no-deps --no-build-isolation -w "$CACHE" "$src/mmcv-2.1.0"
  rm -rf "$src"
}
if ! "$VENV/bin/python" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '2.1.0'" >/dev/null 2>&1; then
  if ! ls "$CACHE"/mmcv-2.1.0-*.whl >/dev/null 2>&1; then
    echo "    (mmcv 2.1.0 wheel not in $CACHE: building it once, ~12 min on 2 cores)"
    step 04-mmcv-build build_mmcv
  fi
  step 05-mmcv-install "${PIP[@]}" install -c "$CONS" --no-deps "$(ls "$CACHE"/mmcv-2.1.0-*.whl | head -1)"
fi
step 06-stack "${PIP[@]}" install -c "$CONS" --no-build-isolation -e "$ROOT[test]"
step 07-pip-check "${PIP[@]}" check
echo "$want" >"$STAMP"
echo "install: done ($VENV)"
