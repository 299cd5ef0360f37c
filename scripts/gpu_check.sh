#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, kernel timings, single-request decode, throughput vs HF.
# Usage (repo root): bash scripts/gpu_check.sh [tests] [kernels] [decode] [throughput]   (default: all)
# Logs and markdown results go to $OUT (or ./gpu_out). The machine's own python3 (with torch, triton,
# transformers) runs it; wheels for what it lacks can be carried in .whl/ and are installed first.
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
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) $PY -m pytest -q -p no:cacheprovider -x tests/kernels/test_kernels.py tests/kernels/test_gpu.py 2>&1 | tail -40 > "$OUT/tests.log" ;;
    kernels) $PY scripts/bench_kernels.py --out "$OUT/kernels_gpu.md" > "$OUT/kernels.log" 2>&1 ;;
    decode)
      [ -d $MODEL ] || (cd scripts && $PY -c "from bench_throughput import make_qwen3_06b; make_qwen3_06b('$MODEL')")
      $PY scripts/bench_decode.py --model $MODEL --out "$OUT/decode_gpu.md" > "$OUT/decode.log" 2>&1 ;;
    throughput)
      $PY scripts/bench_throughput.py --workload g1 --num-requests 256 --model $MODEL --make-qwen3-0.6b \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048 --hf-batch 128 \
        --engines ${ENGINES:-pagedserve,hf} --out "$OUT/throughput_gpu.md" > "$OUT/throughput.log" 2>&1 ;;
  esac
  echo "== $step rc=$? $(( $(date +%s) - start ))s"; tail -25 "$OUT/$step.log" 2>/dev/null
done
