#!/usr/bin/env bash
# Device call: new kernel parity tests, GEMV sweep, profiled 27B decode. Results under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 200 python3 -m pytest -q tests/gpu/test_gemv.py tests/gpu/test_rms_norm.py tests/gpu/test_activation.py \
    tests/gpu/test_gdn_gates.py tests/gpu/test_attention_prep.py tests/gpu/test_fp8_linear.py tests/gpu/test_cuda_graphs.py > "$OUT/tests.log" 2>&1
echo "gpu tests exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/tests.log"
timeout 150 python3 benchmarks/kernels/bench_gemv.py --quick --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/gemv.log"
timeout 200 python3 -m ninfer.cli bench --shapes 27b --weights bf16,fp8 --batches 1,8 --contexts 4096 \
    --prefill 8192 --decode-rounds 10 --peer none --profile --out "$OUT/b27" > "$OUT/b27.log" 2>&1
echo "bench exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/b27.log"
rm -f "$OUT/b27/bench.png"
tail -4 "$OUT/tests.log"; tail -30 "$OUT/gemv.log"; grep -E "tok/s|failed|Error" "$OUT/b27.log" | tail -20
