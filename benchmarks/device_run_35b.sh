#!/usr/bin/env bash
# Device call 2 of 2: `ninfer bench` for 35B-A3B (bf16, HF peer), and 27B batch 1 with PDL off (A/B).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 240 python3 -m ninfer.cli bench --shapes 35b-a3b --weights bf16 --batches 1,2,4,8 --contexts 4096,131072 \
    --prefill 8192 --decode-rounds 10 --peer hf --out "$OUT/b35" > "$OUT/b35.log" 2>&1
echo "bench 35b exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/b35.log"
rm -f "$OUT/b35/bench.png"
NINFER_PDL=0 timeout 120 python3 -m ninfer.cli bench --shapes 27b --weights bf16,fp8 --batches 1 --contexts 4096 \
    --prefill "" --decode-rounds 10 --peer none --out "$OUT/pdl0" > "$OUT/pdl0.log" 2>&1
echo "bench pdl0 exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/pdl0.log"
rm -f "$OUT/pdl0/bench.png" "$OUT/pdl0/bench.json"
grep -hE "tok/s|failed|Error" "$OUT/b35.log" "$OUT/pdl0.log" | tail -40
