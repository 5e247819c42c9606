#!/usr/bin/env bash
# One prepared run for a lent GPU machine (CUDA): the parity tests with moeserve on the GPU
# against the transformers oracle, then the offline benchmark in bf16 and fp32.
# Uses the machine's own python3 (torch, transformers, safetensors, tokenizers, pytest are
# there); the project runs from the source tree. Results land in $OUT (or ./bench_out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench_out}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOESERVE_CACHE=${MOESERVE_CACHE:-/tmp/moeserve-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

MOESERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
  tests/unit/test_model_parity.py 2>&1 | tee "$out/parity_cuda.log"
parity=${PIPESTATUS[0]}

for dtype in bfloat16 float32; do
  timeout 240 python3 benchmarks/offline_throughput.py --device cuda --dtype "$dtype" \
    --formats fp32 --threads 16 --batches 1,8,32,64 --prefill 512,2048 \
    --out "$out/offline_cuda_$dtype.json" --plot "$out/offline_cuda_$dtype.png" 2>&1 \
    | grep -v "Loading weights" | tee "$out/offline_cuda_$dtype.log"
done
echo "parity exit code: $parity"
exit "$parity"
