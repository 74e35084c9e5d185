#!/usr/bin/env bash
# Reproduce the published GPU figures (docs/performance.md) on one NVIDIA GPU.
#
# Usage: benchmarks/gpu_bench.sh [--tests] [27b|35b-a3b|all] [OUT_DIR] [-- EXTRA BENCH FLAGS]
#
#   27b | 35b-a3b | all  which model to benchmark (default: all, 27b first)
#   OUT_DIR              where everything is written (default: bench-results, ignored by git)
#   --tests              afterwards, also run the GPU tests: python3 -m pytest -q -m gpu -n 0 tests (tests/gpu and the GPU cases of tests/kernels, tests/engine)
#   -- FLAGS             appended to each `ninfer bench` command; a later flag wins, e.g.
#                        `-- --peer none` skips HF transformers, `-- --prefill ""` skips prefill
#
# Needs: a CUDA GPU and the project installed with its GPU and test extras:
#   pip install -e ".[gpu,test]"
# The 27B run peaks at 117.0 GiB of GPU memory (its KV pool holds 8 x 128K tokens): an H200
# fits it, an 80 GB GPU does not with these flags.
# The script sets no time limit. To bound it, wrap it: timeout 2h benchmarks/gpu_bench.sh all
#
# Writes, under OUT_DIR:
#   system.txt           GPU (nvidia-smi), driver, package versions, git commit
#   clocks.csv           nvidia-smi every 500 ms while the script runs: SM clock, power, throttle reasons
#   preflight.log        tests/gpu/test_bench_clocks.py (NVML reads the SM clock; the bench's SM MHz column needs it)
#   27b/bench.{json,md,png}, 27b.log             the 27B run (bf16 and FP8)
#   35b-a3b/bench.{json,md,png}, 35b-a3b.log     the 35B-A3B run (bf16 and FP8)
#   tests.log            with --tests
set -uo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

RUN_TESTS=0
WHICH=""
OUT_DIR=""
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) RUN_TESTS=1 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        27b|35b-a3b|all)
            if [ -n "$WHICH" ]; then echo "gpu_bench.sh: model given twice: $1" >&2; exit 2; fi
            WHICH="$1" ;;
        -*) echo "gpu_bench.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
        *)
            if [ -n "$OUT_DIR" ]; then echo "gpu_bench.sh: unexpected argument $1" >&2; usage >&2; exit 2; fi
            OUT_DIR="$1" ;;
    esac
    shift
done
WHICH="${WHICH:-all}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT_DIR:-$ROOT/bench-results}"
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$ROOT" || exit 2  # tests/gpu and the git facts are read from the repository root
case "$WHICH" in
    all) MODELS=(27b 35b-a3b) ;;
    *) MODELS=("$WHICH") ;;
esac

if ! command -v nvidia-smi > /dev/null; then
    echo "gpu_bench.sh: nvidia-smi not found: this needs an NVIDIA GPU and its driver" >&2
    exit 2
fi
if ! python3 -c "import ninfer, torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
    echo "gpu_bench.sh: python3 cannot import ninfer with a CUDA torch; install with: pip install -e \".[gpu,test]\"" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1

# The flags of the published runs (docs/performance.md, "Reproduce"); --shapes comes per model.
PUBLISHED_FLAGS=(--weights bf16,fp8 --batches 1,2,4,8 --contexts 4096,131072 --prefill 8192,65536 --decode-rounds 20 --peer hf)

# --- Facts about the machine --------------------------------------------------------------
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "host: $(uname -n) ($(uname -srm))"
    echo "commit: $(git rev-parse HEAD 2> /dev/null || echo unknown)$(git status --porcelain 2> /dev/null | grep -q . && echo ' (working tree has changes)')"
    echo
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,clocks.max.memory,power.limit,power.max_limit --format=csv
    echo
    python3 - << 'EOF'
import importlib
import platform

print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "fla", "pynvml"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "installed"))
    except Exception as error:  # noqa: BLE001 - report, do not fail
        print(name, "not importable:", type(error).__name__)
try:
    import torch

    print("torch CUDA", torch.version.cuda, "| device", torch.cuda.get_device_name(0))
except Exception as error:  # noqa: BLE001
    print("torch CUDA: not readable:", type(error).__name__)
EOF
    echo
    nvidia-smi
} > "$OUT_DIR/system.txt" 2>&1

# --- Clock and power log for the whole run ------------------------------------------------
REASONS=clocks_event_reasons.active
nvidia-smi --query-gpu=$REASONS --format=csv,noheader > /dev/null 2>&1 || REASONS=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,$REASONS \
    --format=csv -lms 500 > "$OUT_DIR/clocks.csv" 2> /dev/null &
CLOCKS_PID=$!
stop_clocks() { kill "$CLOCKS_PID" 2> /dev/null; wait "$CLOCKS_PID" 2> /dev/null; }
trap stop_clocks EXIT

STATUS=0
declare -A RC

# --- Preflight: NVML reads the SM clock (else the bench's SM MHz column stays empty) --------
python3 -m pytest -q -n 0 tests/gpu/test_bench_clocks.py > "$OUT_DIR/preflight.log" 2>&1
RC[preflight]=$?
[ "${RC[preflight]}" -eq 0 ] || echo "gpu_bench.sh: warning: NVML clock check failed (see $OUT_DIR/preflight.log); continuing" >&2

# --- The benchmark runs -------------------------------------------------------------------
for model in "${MODELS[@]}"; do
    ARGS=(--shapes "$model" "${PUBLISHED_FLAGS[@]}" --out "$OUT_DIR/$model" ${EXTRA[@]+"${EXTRA[@]}"})
    echo "== $(date -u '+%H:%M:%S') ninfer bench ${ARGS[*]}" | tee "$OUT_DIR/$model.log"
    SECONDS=0
    python3 -m ninfer.cli bench "${ARGS[@]}" >> "$OUT_DIR/$model.log" 2>&1
    RC[$model]=$?
    echo "== exit ${RC[$model]} after ${SECONDS} s" | tee -a "$OUT_DIR/$model.log"
    [ "${RC[$model]}" -eq 0 ] || STATUS=1
done

# --- GPU tests ----------------------------------------------------------------------------
if [ "$RUN_TESTS" -eq 1 ]; then
    echo "== $(date -u '+%H:%M:%S') python3 -m pytest -q -m gpu -n 0 tests"
    SECONDS=0
    python3 -m pytest -q -m gpu -n 0 --durations=10 tests > "$OUT_DIR/tests.log" 2>&1
    RC[tests]=$?
    echo "== exit ${RC[tests]} after ${SECONDS} s"
    [ "${RC[tests]}" -eq 0 ] || STATUS=1
fi

stop_clocks
trap - EXIT

# --- Summary ------------------------------------------------------------------------------
echo
echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
echo "NVML clock check: $([ "${RC[preflight]}" -eq 0 ] && echo passed || echo "failed (no SM MHz column)")"
for model in "${MODELS[@]}"; do
    echo
    if [ -f "$OUT_DIR/$model/bench.md" ]; then
        echo "--- $model ($OUT_DIR/$model/bench.md)"
        cat "$OUT_DIR/$model/bench.md"
        python3 - "$OUT_DIR/$model/bench.json" << 'EOF'
import json
import sys

failures = json.load(open(sys.argv[1])).get("failures") or []
for failure in failures:
    print("FAILED CASE:", failure)
EOF
    else
        echo "--- $model: no results (exit ${RC[$model]}); last lines of $OUT_DIR/$model.log:"
        tail -n 20 "$OUT_DIR/$model.log"
    fi
done
if [ "$RUN_TESTS" -eq 1 ]; then
    echo
    echo "--- GPU tests (exit ${RC[tests]}; $OUT_DIR/tests.log)"
    tail -n 3 "$OUT_DIR/tests.log"
fi
echo
echo "Everything is under $OUT_DIR/"
exit $STATUS
