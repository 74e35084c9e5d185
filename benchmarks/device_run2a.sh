#!/usr/bin/env bash
# Device call: the whole GPU test suite, the GEMV sweep, 27B decode with PDL on and off (profiled).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 280 python3 -m pytest -q tests/gpu > "$OUT/tests.log" 2>&1
echo "gpu tests exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/tests.log"
timeout 120 python3 benchmarks/kernels/bench_gemv.py --quick --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/gemv.log"
for pdl in 1 0; do
  NINFER_PDL=$pdl timeout 90 python3 -m ninfer.cli bench --shapes 27b --weights bf16,fp8 --batches 1,2,8 --contexts 4096 \
      --prefill "" --decode-rounds 10 --peer none --profile --out "$OUT/pdl$pdl" > "$OUT/pdl$pdl.log" 2>&1
  echo "bench pdl=$pdl exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/pdl$pdl.log"
  rm -f "$OUT/pdl$pdl/bench.png" "$OUT/pdl$pdl/bench.json" "$OUT/pdl$pdl"/profile-*bf16*
done
rm -f "$OUT"/pdl0/profile-*
tail -4 "$OUT/tests.log"; grep -E "FAILED" "$OUT/tests.log" | head; tail -12 "$OUT/gemv.log"; grep -hE "tok/s|failed|Error" "$OUT"/pdl*.log | tail -20
