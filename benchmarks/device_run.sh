#!/usr/bin/env bash
# One device-tool call: GPU parity tests, then `ninfer bench` for 27B and 35B-A3B, results under $OUT.
# Usage (device tool, carry .whl): bash benchmarks/device_run.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/tests.log"
timeout 110 python3 -m pytest -q -x tests/gpu/test_cuda_graphs.py tests/gpu/test_paged_attention.py >> "$OUT/tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/tests.log"
timeout 300 python3 -m ninfer.cli bench --shapes 27b --weights bf16,fp8 --batches 1,8 --contexts 4096,131072 \
    --prefill 8192,65536 --decode-rounds 10 --peer hf --out "$OUT/b27" > "$OUT/b27.log" 2>&1
echo "bench 27b exit $?" >> "$OUT/b27.log"
timeout 150 python3 -m ninfer.cli bench --shapes 35b-a3b --weights bf16 --batches 1,8 --contexts 4096,131072 \
    --prefill 8192 --decode-rounds 10 --peer hf --out "$OUT/b35" > "$OUT/b35.log" 2>&1
echo "bench 35b exit $?" >> "$OUT/b35.log"
rm -f "$OUT/b35/bench.png"
tail -3 "$OUT/tests.log"; grep -E "tok/s|failed|Error" "$OUT/b27.log" "$OUT/b35.log" | tail -40
