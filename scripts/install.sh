#!/usr/bin/env bash
# Idempotent install of tokenaug and its upstream stack into a venv inside the repo.
#
#   bash scripts/install.sh [VENV]        (default: .venv; called by `make install`)
#
# Steps (each skipped when already satisfied; a stamp file makes a second call a no-op):
#   1. python3.11 venv
#   2. torch 2.14.1 + torchvision 0.29.1 (pip takes them from this machine's local wheel index)
#   3. setuptools<81 (mmcv's setup.py and mmengine's `pkg::` config lookup import pkg_resources) + ninja
#   4. mmcv 2.1.0 with CPU ops, built from its PyPI sdist by shared_core/tools/mmcv_wheel.py (the
#      `tokenaug-mmcv-wheel` console script). torch >= 2.10 headers need C++20 and mmcv 2.1.0's
#      setup.py hard-codes -std=c++17, so the sdist is patched. The wheel is built once into a cache
#      outside the repo ($TOKENAUG_WHEEL_CACHE, default ~/.cache/tokenaug/wheels): pip does not cache
#      wheels built from a local folder, and the build takes ~12 min on 2 cores.
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
want=$(cat "$CONS" "$ROOT/pyproject.toml" "$0" "$ROOT/shared_core/tools/mmcv_wheel.py" | sha256sum | cut -d' ' -f1)

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

# one copy of the find-or-build logic (and what `tokenaug-mmcv-wheel` runs for pip users): cached wheel, else
# download the sdist, patch -std=c++17 -> -std=c++20, build with CPU ops into $CACHE; --install pip installs it
MMCV_WHEEL=("$VENV/bin/python" "$ROOT/shared_core/tools/mmcv_wheel.py" --cache "$CACHE" --constraints "$CONS")
if ! "$VENV/bin/python" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '2.1.0'" >/dev/null 2>&1; then
  "${MMCV_WHEEL[@]}" --dry-run 2>&1 >/dev/null | sed 's/^tokenaug-mmcv-wheel: /    (/; s/$/)/'
  step 04-mmcv "${MMCV_WHEEL[@]}" --install
fi
step 06-stack "${PIP[@]}" install -c "$CONS" --no-build-isolation -e "$ROOT[test]"
step 07-pip-check "${PIP[@]}" check
echo "$want" >"$STAMP"
echo "install: done ($VENV)"
