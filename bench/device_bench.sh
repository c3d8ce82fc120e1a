#!/bin/bash
# The GPU figures of bench/RESULTS.md, in one run on a machine with a CUDA GPU (a timm 1.0.31 wheel in .whl/ is
# installed first, as that machine's timm may differ; mm packages are not needed by these benchmarks):
#   bash bench/device_bench.sh      (writes its tables to $OUT, or to ./bench_out without $OUT)
# Every method's training step against its baseline (interleaved, medians, bf16 autocast), eager first, then
# through torch.compile (inductor); each line has its own time limit so that one slow compile cannot take the
# rows after it. Six files: env.txt, kernel.txt (the Triton label-attention kernel checked against SDPA in fp32
# and bf16, its gradients, and its attention forward + backward against plain SDPA; then its tests on CUDA tensors
# where pytest is installed), tl_align.txt (TL-Align and TransMix vs CutMix: the default label path, the Triton
# kernel on CUDA, and SDPA with label columns for comparison), token_labels.txt, mixers.txt (on-device MixUp /
# CutMix / TokenMix vs timm's Mixup, collates), tokenmixup.txt (HTM at τ 100 and the public τ 0.2, VTM, HTM+VTM
# vs plain; HTM's plan against its bare assignment).
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
{ python3 -c "import torch, timm, torchvision; print('torch', torch.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nproc; } 2>&1 | tee "$OUT/env.txt"
# in the order of what matters most (each file gets its rows as they finish: a run cut short keeps them)
# the label kernel: is it right on this GPU, and what does its attention cost
bench kernel.txt 90 bench/kernel_check.py --batch 128 --repeats 50
# TL-Align: eager and compiled, batch 128 and 256 (the default label path: the Triton kernel), SDPA columns beside
bench tl_align.txt 120 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 20 --amp --profile
bench tl_align.txt 60 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 256 --repeats 10 --amp --default-only
bench tl_align.txt 150 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 20 --amp --compile inductor --default-only
bench tl_align.txt 120 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 256 --repeats 10 --amp --compile inductor --default-only
bench tl_align.txt 60 bench/bench_tl_align.py --device cuda --model deit_small_patch16_224 --batch 128 --repeats 10 --amp --default-only --fused sdpa
# TokenMixup: HTM at τ 100 (all easy) and the public 0.2, HTM+VTM; the plan; compiled
bench tokenmixup.txt 60 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 20 --amp
bench tokenmixup.txt 60 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 20 --amp --tau 0.2
bench tokenmixup.txt 30 bench/bench_tokenmixup.py --device cuda --batch 128 --plan-only
bench tokenmixup.txt 100 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 10 --amp --compile inductor
# token labeling, mixers
bench token_labels.txt 150 bench/bench_token_labels.py --device cuda --images 128 --rounds 5 --step-model deit_small_patch16_224 --amp --profile
bench mixers.txt 90 bench/bench_mixers.py --device cuda --repeats 50
bench token_labels.txt 120 bench/bench_token_labels.py --device cuda --images 16 --rounds 5 --step-model deit_small_patch16_224 --amp --compile inductor
# the kernel's tests on CUDA tensors, where pytest is installed
if python3 -c "import pytest, hypothesis" 2>/dev/null; then
  echo "## pytest tests/shared_core/test_label_kernel.py (CUDA tensors)" | tee -a "$OUT/kernel.txt"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/shared_core/test_label_kernel.py 2>&1 | tail -15 | tee -a "$OUT/kernel.txt"
fi
