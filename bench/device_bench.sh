#!/bin/bash
# The GPU figures of bench/RESULTS.md, in one run on a device machine (timm 1.0.31 carried as a wheel in
# .whl/, as the device image's timm may differ; mm packages are not needed by these benchmarks):
#   bash bench/device_bench.sh      (writes its tables to $OUT, or to ./bench_out without $OUT)
set -o pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
python3 -c "import torch, timm, torchvision; print('torch', torch.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
python3 bench/bench_token_labels.py --device cuda --images 256 --rounds 5 --step-model deit_small_patch16_224 --amp 2>&1 | tee "$OUT/token_labels.txt"
python3 bench/bench_token_labels.py --device cuda --images 16 --rounds 5 --step-model deit_small_patch16_224 --amp --compile inductor 2>&1 | tee "$OUT/token_labels_compiled.txt"
python3 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 20 --amp 2>&1 | tee "$OUT/tl_align.txt"
python3 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 20 --amp --compile inductor 2>&1 | tee "$OUT/tl_align_compiled.txt"
python3 bench/bench_mixers.py --device cuda --repeats 50 2>&1 | tee "$OUT/mixers.txt"
