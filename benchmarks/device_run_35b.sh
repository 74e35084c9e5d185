#!/usr/bin/env bash
# Device call 2 of 2: `ninfer bench` for 35B-A3B (bf16, HF peer), then its prefill alone with the
# kernel table and timeline (docs/perf/bench-35b-a3b-prefill.*, profile-35b-a3b-prefill-8192.txt).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 240 python3 -m ninfer.cli bench --shapes 35b-a3b --weights bf16 --batches 1,2,4,8 --contexts 4096,131072 \
    --prefill 8192 --decode-rounds 10 --peer hf --out "$OUT/b35" > "$OUT/b35.log" 2>&1
echo "bench 35b exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/b35.log"
rm -f "$OUT/b35/bench.png"
timeout 200 python3 -m ninfer.cli bench --shapes 35b-a3b --weights bf16 --batches 1 --contexts 4096 \
    --prefill 8192,65536 --decode-rounds 10 --peer none --profile --out "$OUT/b35p" > "$OUT/b35p.log" 2>&1
echo "bench 35b prefill exit $? ($(( $(date +%s) - T0 ))s)" >> "$OUT/b35p.log"
rm -f "$OUT/b35p/bench.png" "$OUT"/b35p/*b1-4096*  # at most 8 files come back
grep -hE "tok/s|failed|Error" "$OUT/b35.log" "$OUT/b35p.log" | tail -40
