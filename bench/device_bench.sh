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
source bench/device_common.sh
check_stack env.txt
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
