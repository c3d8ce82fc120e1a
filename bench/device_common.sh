# What both GPU slots share (sourced by bench/device_bench.sh and bench/device_bench_methods.sh): the timm wheel in
# .whl/ installed first, $OUT, the stack refused unless timm is 1.0.31, and bench FILE LIMIT_S SCRIPT ARGS...
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
check_stack() {  # check_stack FILE: the stack appended to $OUT/FILE; exit 2 unless timm is 1.0.31
  { python3 -c "import torch, timm, torchvision, triton; print('torch', torch.__version__, 'timm', timm.__version__, 'torchvision', torchvision.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nproc; } 2>&1 | tee -a "$OUT/$1"
  if ! python3 -c "import timm, sys; sys.exit(timm.__version__ != '1.0.31')"; then
    echo "timm $(python3 -c 'import timm; print(timm.__version__)'): the GPU slots are written for timm 1.0.31 (put its wheel in .whl/)" | tee -a "$OUT/$1"
    exit 2
  fi
}
