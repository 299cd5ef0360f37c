#!/usr/bin/env bash
# One call on a GPU machine for async scheduling on the device (GPU backlog 1.1): its tests on CUDA, then
# S1 (one request, 128 in, 513 out) and G1 (256 requests, lengths uniform in 100-1024) with
# --async-scheduling off and on, alternated, same machine. Results: $OUT/gpu_results.jsonl; logs in $OUT.
# Usage (repo root): bash scripts/gpu_async_check.sh [tests] [decode] [throughput] [more_tests]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
mkdir -p /tmp/ps_path && ln -sfn "$PWD" /tmp/ps_path/pagedserve
export PYTHONPATH=/tmp/ps_path${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
MODEL=/tmp/qwen3-0.6b
BENCH="$PY -m pagedserve.frontend.pagedserve_cli bench"
RESULTS="$OUT/gpu_results.jsonl"
PYTEST="$PY -m pytest -q -p no:cacheprovider -o addopts="
for step in ${*:-tests decode throughput more_tests}; do
  start=$(date +%s)
  case $step in
    tests) timeout 150 $PYTEST tests/executor/test_device_async.py > "$OUT/tests.log" 2>&1 ;;
    decode)
      for rep in 1 2; do for mode in off on; do
        flag=; [ $mode = on ] && flag=--async-scheduling
        timeout 100 $BENCH latency --make-model qwen3-0.6b --model $MODEL --dtype bfloat16 --max-model-len 2048 \
          --gpu-memory-utilization 0.5 $flag --batch-size 1 --input-len 128 --output-len 513 \
          --num-iters-warmup 2 --num-iters 5 --bandwidth-bound --label "pagedserve async-$mode" \
          --result-file "$RESULTS"
      done; done > "$OUT/decode.log" 2>&1 ;;
    throughput)
      for mode in off on; do
        flag=; [ $mode = on ] && flag=--async-scheduling
        timeout 120 $BENCH throughput --make-model qwen3-0.6b --model $MODEL --dataset-name g1 --backend pagedserve \
          --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048 $flag \
          --label "pagedserve async-$mode" --result-file "$RESULTS"
      done > "$OUT/throughput.log" 2>&1 ;;
    more_tests) timeout ${MORE_TESTS_S:-200} $PYTEST tests/core/test_async_scheduling.py tests/kernels/test_gpu.py \
        > "$OUT/more_tests.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"; tail -${TAIL:-8} "$OUT/$step.log" 2>/dev/null
done
grep -h "decode_ms_per_tok\|output_tokens_per_second" "$RESULTS" 2>/dev/null | $PY -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['label'], r['bench'], {k: round(v, 3) for k, v in r.items() if k in ('decode_ms_per_tok', 'bound_ms_per_tok', 'output_tokens_per_second')})
"
