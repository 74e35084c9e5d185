#!/usr/bin/env bash
# Device call 1 of 2: `ninfer bench` for 27B (bf16 + FP8, HF peer), then the GPU tests in the time left.
# Usage (device tool, carry .whl): bash benchmarks/device_run.sh   — then benchmarks/device_run_35b.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/tests.log"
timeout 330 python3 -m ninfer.cli bench --shapes 27b --weights bf16,fp8 --batches 1,2,4,8 --contexts 4096,131072 \
    --prefill 8192,65536 --decode-rounds 10 --peer hf --out "$OUT/b27" > "$OUT/b27.log" 2>&1
echo "bench 27b exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/b27.log"
LEFT=$(( 575 - ($(date +%s) - T0) ))
timeout $LEFT python3 -m pytest -q --durations=10 tests/gpu/test_cuda_graphs.py tests/gpu/test_pdl.py \
    tests/gpu/test_paged_attention.py tests/gpu/test_rms_norm.py tests/gpu/test_gemv.py >> "$OUT/tests.log" 2>&1
echo "gpu tests exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/tests.log"
tail -16 "$OUT/tests.log"; grep -E "tok/s|failed|Error" "$OUT/b27.log" | tail -40
