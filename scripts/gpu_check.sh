#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, kernel timings, single-request decode, throughput vs HF.
# Usage (repo root): bash scripts/gpu_check.sh [tests] [kernels] [decode] [throughput]   (default: all)
# Logs go to $OUT (or ./gpu_out), results as JSON lines to $OUT/gpu_results.jsonl (kernel tables as markdown).
# The machine's own python3 (with torch, triton, transformers) runs it; wheels for what it lacks can be carried
# in .whl/ and are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then $PY -m pip install --quiet --no-index --no-deps .whl/*.whl; fi
# Import the checkout as `pagedserve` without installing it.
mkdir -p /tmp/ps_path && ln -sfn "$PWD" /tmp/ps_path/pagedserve
export PYTHONPATH=/tmp/ps_path${PYTHONPATH:+:$PYTHONPATH}
steps=${*:-tests kernels decode throughput}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
MODEL=/tmp/qwen3-0.6b
BENCH="$PY -m pagedserve.frontend.pagedserve_cli bench"
RESULTS="$OUT/gpu_results.jsonl"
G1_ENGINE="--max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048"
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) $PY -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernels.py tests/kernels/test_gpu.py 2>&1 | tail -40 > "$OUT/tests.log" ;;
    kernels) $PY scripts/bench_kernels.py --out "$OUT/kernels_gpu.md" > "$OUT/kernels.log" 2>&1 ;;
    decode)   # S1: one request, 128 prompt tokens, decode ms per token against the weight-bandwidth floor
      for eager in "" --enforce-eager; do
        $BENCH latency --make-model qwen3-0.6b --model $MODEL --dtype bfloat16 --max-model-len 2048 \
          --gpu-memory-utilization 0.5 $eager --batch-size 1 --input-len 128 --output-len 513 \
          --num-iters-warmup 2 --num-iters 5 --bandwidth-bound --label "pagedserve${eager:+ eager}" \
          --result-file "$RESULTS"
      done > "$OUT/decode.log" 2>&1 ;;
    throughput)   # G1: 256 requests, prompt and output lengths uniform in 100-1024, against HF static batches
      for backend in ${BACKENDS:-pagedserve hf}; do
        extra=$G1_ENGINE; [ "$backend" = hf ] && extra="--hf-max-batch-size 128 --dtype bfloat16"
        $BENCH throughput --make-model qwen3-0.6b --model $MODEL --dataset-name g1 --backend "$backend" $extra \
          --result-file "$RESULTS"
      done > "$OUT/throughput.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"; tail -25 "$OUT/$step.log" 2>/dev/null
done
