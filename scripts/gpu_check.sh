#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, kernel timings, single-request decode, throughput vs HF, and async
# scheduling on the device (its tests, then S1 and G1 with --async-scheduling off and on, alternated).
# Usage (repo root): bash scripts/gpu_check.sh [tests] [kernels] [decode] [throughput] [async_tests] [async_bench]
#   (default: tests kernels decode throughput)
# Logs go to $OUT (or ./gpu_out), results as JSON lines to $OUT/gpu_results.jsonl (kernel tables as markdown).
# The machine's own python3 (with torch, triton, transformers) runs it; wheels for what it lacks can be carried
# in .whl/ and are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# Import the checkout as `pagedserve` without installing it.
mkdir -p /tmp/ps_path && ln -sfn "$PWD" /tmp/ps_path/pagedserve
export PYTHONPATH=/tmp/ps_path${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-tests kernels decode throughput}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
MODEL=/tmp/qwen3-0.6b
BENCH="$PY -m pagedserve.frontend.pagedserve_cli bench"
RESULTS="$OUT/gpu_results.jsonl"
PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts="
G1_ENGINE="--max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048"
s1() {   # S1: one request, 128 prompt tokens, decode ms per token against the weight-bandwidth floor
  timeout 150 $BENCH latency --make-model qwen3-0.6b --model $MODEL --dtype bfloat16 --max-model-len 2048 \
    --gpu-memory-utilization 0.5 --batch-size 1 --input-len 128 --output-len 513 --num-iters-warmup 2 \
    --num-iters 5 --bandwidth-bound --result-file "$RESULTS" "$@"
}
g1() {   # G1: 256 requests, prompt and output lengths uniform in 100-1024
  timeout 300 $BENCH throughput --make-model qwen3-0.6b --model $MODEL --dataset-name g1 --result-file "$RESULTS" "$@"
}
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) $PYTEST -x tests/kernels/test_kernels.py tests/kernels/test_gpu.py > "$OUT/tests.log" 2>&1 ;;
    kernels) $BENCH kernels --out "$OUT/kernels_gpu.md" > "$OUT/kernels.log" 2>&1 ;;
    decode) { s1 --label pagedserve; s1 --enforce-eager --label "pagedserve eager"; } > "$OUT/decode.log" 2>&1 ;;
    throughput)
      for backend in ${BACKENDS:-pagedserve hf}; do
        if [ "$backend" = hf ]; then g1 --backend hf --hf-max-batch-size 128 --dtype bfloat16
        else g1 --backend pagedserve $G1_ENGINE; fi
      done > "$OUT/throughput.log" 2>&1 ;;
    async_tests) timeout 200 $PYTEST tests/executor/worker/test_device_async.py tests/kernels/test_gpu.py \
      > "$OUT/async_tests.log" 2>&1 ;;
    async_bench)
      { for mode in off on off on; do
          flag=; [ $mode = on ] && flag=--async-scheduling
          s1 $flag --label "pagedserve async-$mode"
        done
        for mode in off on; do
          flag=; [ $mode = on ] && flag=--async-scheduling
          g1 --backend pagedserve $G1_ENGINE $flag --label "pagedserve async-$mode"
        done; } > "$OUT/async_bench.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"; tail -${TAIL:-25} "$OUT/$step.log" 2>/dev/null
done
