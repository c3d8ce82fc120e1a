#!/bin/bash
# The GPU slot that matters first: TL-Align's label kernels and label paths on a machine with a CUDA GPU.
#   bash bench/device_bench.sh              (writes its tables to $OUT, or to ./bench_out without $OUT)
#   bash bench/device_bench_methods.sh      (the second slot: TokenMixup, token labeling, mixers)
# A timm 1.0.31 wheel in .whl/ is installed first (the device machine's own timm may differ); a timm other than the
# one SharedAttentionViT's copy of Attention.forward was written for (1.0.31) is refused. The stack it ran on goes to
# env.txt. Every line has its own time limit, and the limits add up to 460 s, inside one 600 s device command with
# the install. Files: env.txt; kernel.txt (bench/kernel_check.py: both kernels checked against SDPA and the rule in
# fp32 and bf16 with their self-checks, the backend plain SDPA runs, whether the fused kernel's backward ran
# flash's, one block's forward and backward apart on each path with CUDA events; then the kernels' tests on CUDA
# tensors where pytest is installed); tl_align.txt (bench/bench_tl_align.py --paths: TL-Align on DeiT-S bf16 against
# the CutMix step for each label path, auto naming what it picked, eager at batch 32, 128 and 256, compiled at 128).
set -o pipefail
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
start=$SECONDS
bench() {  # bench FILE LIMIT_S SCRIPT ARGS...: one benchmark, appended to $OUT/FILE, stopped after LIMIT_S
  local file=$1 limit=$2; shift 2
  echo "## python3 $* (limit ${limit}s, at ${SECONDS}s)" | tee -a "$OUT/$file"
  timeout "$limit" python3 "$@" 2>&1 | grep -v -e '^W[0-9]' -e 'UserWarning' -e '^  warnings.warn' | tee -a "$OUT/$file"
  echo "## exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$OUT/$file"
}
{ python3 -c "import torch, timm, torchvision, triton; print('torch', torch.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
if ! python3 -c "import timm, sys; sys.exit(timm.__version__ != '1.0.31')"; then
  echo "timm $(python3 -c 'import timm; print(timm.__version__)'): device_bench.sh is written for timm 1.0.31 (put its wheel in .whl/)" | tee -a "$OUT/env.txt"
  exit 2
fi
# the label kernels: are they right on this GPU, and what does each path add to one block's attention
bench kernel.txt 60 bench/kernel_check.py --batch 128 --rounds 7 --iters 20
if python3 -c "import pytest, hypothesis" 2>/dev/null; then
  echo "## pytest tests/shared_core/test_label_kernel.py (CUDA tensors, at ${SECONDS}s)" | tee -a "$OUT/kernel.txt"
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/shared_core/test_label_kernel.py 2>&1 | tail -15 | tee -a "$OUT/kernel.txt"
fi
# TL-Align's label paths against the CutMix step, DeiT-S bf16: eager at three batches, compiled at 128
for batch in 32 128 256; do
  limit=$([ "$batch" = 128 ] && echo 90 || echo 60)
  bench tl_align.txt "$limit" bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch "$batch" --repeats 10 --amp --paths auto,triton,labels,sdpa
done
bench tl_align.txt 100 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 10 --amp --compile inductor --paths auto,triton,labels
echo "## device_bench.sh done after $((SECONDS - start))s" | tee -a "$OUT/env.txt"
