#!/bin/bash
# Screenshots of built documentation pages in headless Chromium (Debian's `chromium` package), for a look at the
# rendered site after `make docs`: navigation, a picture, an API page. Not part of the tests (Chromium is not a
# dependency). Usage: bash scripts/docs_screenshots.sh [OUT_DIR] [PAGE.html ...] (pages relative to the build).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/docs/screenshots}
shift || true
pages=("$@")
[ ${#pages[@]} -gt 0 ] || pages=(methods/tl_align.html api/generated/timm_plugin.recipe.html)
html=$root/docs/_build/html
[ -f "$html/index.html" ] || { echo "docs_screenshots: no $html/index.html; run make docs first" >&2; exit 2; }
mkdir -p "$out"
for page in "${pages[@]}"; do
  name=$(echo "${page%.html}" | tr '/.' '__')
  prof=$(mktemp -d)
  timeout 120 chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$prof" --hide-scrollbars \
    --window-size=1400,1300 --screenshot="$out/$name.png" "file://$html/$page" 2>/dev/null
  rm -rf "$prof"
  # a 64-colour palette keeps the file small in the repository
  "$root/.venv/bin/python" -c "import sys; from PIL import Image; p = sys.argv[1]; Image.open(p).convert('RGB').quantize(64).save(p, optimize=True)" "$out/$name.png"
  echo "$out/$name.png"
done
