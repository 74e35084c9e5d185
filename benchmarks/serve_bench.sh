#!/usr/bin/env bash
# Reproduce the published through-`ninfer-serve` figures (docs/performance.md, docs/api.md) on one
# NVIDIA GPU: each scenario starts its own server on the 27B shapes with random weights.
#
# Usage: benchmarks/serve_bench.sh [SCENARIO ...] [--model DIR] [--out OUT_DIR]
#
#   startup       a server's start and first request three times: the first start on this machine
#                 compiles every kernel, the second reads the kernel cache (load.py cold-start), the
#                 third starts on an empty cache directory (a packaged kernel manifest for the
#                 model, if any, compiles ahead); the first start's kernel manifest is copied to
#                 OUT_DIR/kernel-manifests
#   constrained   plain against JSON-schema constrained decode at 1 and 8 clients
#   agent-loop    three interleaved agent sessions at --max-concurrency 1 (the context cache)
#   burst         8 x 4K prompts at once, at --mixed-prefill-chunk 256, 512 and 1024
#   nvfp4         the bf16 checkpoint served with --quantize nvfp4 (load peak, decode at 1 and 8 clients)
#   speculative   --spec mtp (3 drafts, the reduced proposal head) at one client against plain decoding, at full
#                 acceptance (a --constant-output checkpoint with the MTP head, written to MODEL-constant) and
#                 at zero (the random MTP head, MODEL-mtp), bf16 and --quantize fp8; greedy requests without
#                 penalties (the constant output repeats its token only then). The two checkpoints take
#                 108 GB more beside MODEL: where MODEL is in /dev/shm (host memory), give a disk path
#   (none given: all of them, in this order)
#
#   --model DIR   a 27B-shaped checkpoint (default /dev/shm/q27, written by
#                 `ninfer write-checkpoint --shape 27b` when absent: 53.8 GB)
#   --out DIR     where everything is written (default serve-results, ignored by git)
#
# Needs: a CUDA GPU with 80 GB and the project installed with its GPU and test extras, so that
# `ninfer-serve` is on PATH: pip install -e ".[gpu,test]". The script sets no time limit; the
# whole set takes about 22 minutes on an H100, and speculative about 12 more (two checkpoints, six servers).
set -uo pipefail

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }

ALL=(startup constrained agent-loop burst nvfp4 speculative)
SCENARIOS=()
MODEL=/dev/shm/q27
OUT_DIR=""
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --model) MODEL="$2"; shift ;;
        --out) OUT_DIR="$2"; shift ;;
        startup|constrained|agent-loop|burst|nvfp4|speculative) SCENARIOS+=("$1") ;;
        *) echo "serve_bench.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
[ ${#SCENARIOS[@]} -gt 0 ] || SCENARIOS=("${ALL[@]}")
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT_DIR:-$ROOT/serve-results}"
mkdir -p "$OUT_DIR" || exit 2
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1

if ! command -v ninfer-serve > /dev/null; then
    echo "serve_bench.sh: ninfer-serve is not on PATH; install with: pip install -e \".[gpu,test]\"" >&2
    exit 2
fi
if [ ! -f "$MODEL/config.json" ]; then
    echo "== writing the 27B-shaped checkpoint to $MODEL"
    python3 -m ninfer.cli write-checkpoint "$MODEL" --shape 27b || exit 1
fi

SERVE8="--max-concurrency 8 --max-context 16384 --kv-capacity auto"
NO_THINKING='"enable_thinking": false'
GREEDY='"temperature": 0, "presence_penalty": 0'
SCHEMA='"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": true, "schema": {"type": "object", "properties": {"answer": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}}, "required": ["answer", "notes"], "additionalProperties": false}}}'
DECODE=(--scenario concurrency --concurrency-levels 1,8 --requests-per-client 3 --prompt-tokens 256 --output-tokens 128)
STATUS=0

room_for_checkpoint() {  # dir: whether its file system has the 54 GB a 27B-shaped checkpoint takes
    local parent free_gb
    parent="$(dirname "$1")"
    free_gb=$(( $(df -Pk "$parent" | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
    [ "$free_gb" -ge 56 ] && return 0
    echo "serve_bench.sh: $parent has $free_gb GB free; $1 needs 54 GB (a checkpoint in /dev/shm takes host memory: give --model a disk path)" >&2
    return 1
}

run() {  # name, command...: its output in OUT_DIR/name.log, a failure noted
    local name="$1"
    shift
    echo "== $(date -u '+%H:%M:%S') $name: $*" | tee "$OUT_DIR/$name.log"
    SECONDS=0
    "$@" >> "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "== exit $rc after ${SECONDS} s" | tee -a "$OUT_DIR/$name.log"
    [ "$rc" -eq 0 ] || STATUS=1
}

for scenario in "${SCENARIOS[@]}"; do
    case "$scenario" in
        startup)
            EMPTY_CACHE="$(mktemp -d)"
            for start in first second empty-cache; do
                CACHE_ENV=()
                [ "$start" = empty-cache ] && CACHE_ENV=(env -u TRITON_CACHE_DIR "NINFER_CACHE_DIR=$EMPTY_CACHE")
                run "startup-$start" "${CACHE_ENV[@]}" python3 benchmarks/load.py --serve "$MODEL" \
                    --server-args "$SERVE8" --scenario cold-start --prompt-tokens 256 --output-tokens 128 \
                    --body-extra "{$NO_THINKING}" --ready-timeout 600 --out "$OUT_DIR/startup-$start"
            done
            mkdir -p "$OUT_DIR/kernel-manifests"
            cp "${NINFER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ninfer}"/kernel-manifests/*.json "$OUT_DIR/kernel-manifests/" 2>/dev/null
            rm -rf "$EMPTY_CACHE" ;;
        constrained)
            run constrained-plain python3 benchmarks/load.py --serve "$MODEL" --server-args "$SERVE8" "${DECODE[@]}" \
                --body-extra "{$NO_THINKING}" --out "$OUT_DIR/constrained-plain"
            run constrained-json-schema python3 benchmarks/load.py --serve "$MODEL" --server-args "$SERVE8" "${DECODE[@]}" \
                --body-extra "{$NO_THINKING, $SCHEMA}" --out "$OUT_DIR/constrained-json-schema" ;;
        agent-loop)
            run agent-loop python3 benchmarks/agent_loop.py --serve "$MODEL" \
                "--server-args=--max-concurrency 1 --max-context 65536 --kv-capacity auto" \
                --sessions 3 --turns 5 --prefix-tokens 12000 --result-tokens 1000,2000 --max-tokens 16 \
                --out "$OUT_DIR/agent-loop" ;;
        burst)
            for chunk in 256 512 1024; do
                run "burst-$chunk" python3 benchmarks/load.py --serve "$MODEL" \
                    --server-args "--max-concurrency 8 --max-context 32768 --kv-capacity auto --mixed-prefill-chunk $chunk" \
                    --scenario burst --output-tokens 256 --body-extra "{$NO_THINKING}" --out "$OUT_DIR/burst-$chunk"
            done ;;
        nvfp4)
            run nvfp4 python3 benchmarks/load.py --serve "$MODEL" --server-args "--quantize nvfp4 $SERVE8" \
                --scenario concurrency --concurrency-levels 1,8 --requests-per-client 2 --prompt-tokens 1024 \
                --output-tokens 128 --body-extra "{$NO_THINKING}" --out "$OUT_DIR/nvfp4" ;;
        speculative)
            for variant in constant mtp; do
                [ -f "$MODEL-$variant/config.json" ] && continue
                room_for_checkpoint "$MODEL-$variant" || { STATUS=1; continue 2; }
                flags="--mtp"
                [ "$variant" = constant ] && flags="--mtp --constant-output"
                python3 -m ninfer.cli write-checkpoint "$MODEL-$variant" --shape 27b $flags || { STATUS=1; continue 2; }
            done
            SPEC="--spec mtp --draft-tokens 3 --lm-head-draft"
            ONE=(--scenario concurrency --concurrency-levels 1 --requests-per-client 3 --prompt-tokens 1024 --output-tokens 256)
            for weights in bf16 fp8; do
                QUANTIZE=""
                [ "$weights" = fp8 ] && QUANTIZE="--quantize fp8"
                for server in "plain:constant:" "full:constant:$SPEC" "zero:mtp:$SPEC"; do
                    IFS=: read -r label model flags <<< "$server"
                    run "spec-$label-$weights" python3 benchmarks/load.py --serve "$MODEL-$model" \
                        --server-args "--max-concurrency 1 --max-context 8192 --kv-capacity auto $QUANTIZE $flags" \
                        "${ONE[@]}" --body-extra "{$NO_THINKING, $GREEDY}" --out "$OUT_DIR/spec-$label-$weights"
                done
            done ;;
    esac
done

echo
for name in "$OUT_DIR"/*/load.md "$OUT_DIR"/*/agent_loop.md; do
    [ -f "$name" ] || continue
    echo "--- $name"
    grep -E '^\||^- ' "$name" | head -20
done
echo
echo "Everything is under $OUT_DIR/"
exit $STATUS
