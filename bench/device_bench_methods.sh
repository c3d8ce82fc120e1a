#!/bin/bash
# The second GPU slot: TokenMixup, token labeling and the mixers on a machine with a CUDA GPU (after
# bench/device_bench.sh, the kernels and TL-Align). Same install, stack check and per-line limits (470 s in all).
#   bash bench/device_bench_methods.sh      (writes tokenmixup.txt, token_labels.txt, mixers.txt to $OUT)
source bench/device_common.sh
check_stack env.txt
# TokenMixup: HTM at τ 100 (all easy) and the public 0.2; the plan; compiled
bench tokenmixup.txt 50 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 20 --amp
bench tokenmixup.txt 50 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 20 --amp --tau 0.2
bench tokenmixup.txt 20 bench/bench_tokenmixup.py --device cuda --batch 128 --plan-only
bench tokenmixup.txt 90 bench/bench_tokenmixup.py --device cuda --model cct_7_3x1_32 --batch 128 --repeats 10 --amp --compile inductor
# token labeling, mixers
bench token_labels.txt 110 bench/bench_token_labels.py --device cuda --images 128 --rounds 5 --step-model deit_small_patch16_224 --amp --profile
bench mixers.txt 60 bench/bench_mixers.py --device cuda --repeats 50
bench token_labels.txt 90 bench/bench_token_labels.py --device cuda --images 16 --rounds 5 --step-model deit_small_patch16_224 --amp --compile inductor
echo "## device_bench_methods.sh done after $((SECONDS - start))s" | tee -a "$OUT/tokenmixup.txt"
