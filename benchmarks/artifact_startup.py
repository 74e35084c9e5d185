"""ninfer-serve start-up from an artifact vs from its .ninfer container: seconds to /health ready.

Packs --model (an HF directory or GGUF file; timed) into --container unless it exists, then
starts ninfer-serve on each in turn (source, container, source, ...) --runs times with the
same --server-args, measuring from the process start to the first /health 200 (polled every
50 ms), and the engine's own "model loaded in" time from its log. Pairs are alternated so a
drift of the machine's speed moves both alike. The page cache is warm after the first run of
each (both read the same bytes each time), which is how a restarted server sees them.

Writes startup.json and startup.md into --out.

  python3 benchmarks/artifact_startup.py --runs 3 --out /tmp/startup      # the embedded model
  python3 benchmarks/artifact_startup.py --model /dev/shm/q27 --container /dev/shm/q27.ninfer \\
      --pack-args "--weights fp8" --server-args "--max-context 8192" --out $OUT/startup
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import stop_server  # noqa: E402

_LOADED = re.compile(r"model loaded in ([0-9.]+)s")


def time_to_ready(command: list[str], port: int, log_path: Path, timeout: float) -> tuple[float, float | None]:
    """(seconds from start to /health 200, the log's model-loaded seconds) of one server start."""
    started = time.perf_counter()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL,
                               stderr=open(log_path, "w"), start_new_session=True)  # noqa: SIM115
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{shlex.join(command)} exited with {process.returncode}; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - started
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"not ready within {timeout:.0f} s; see {log_path}")
            time.sleep(0.05)
    finally:
        stop_server(process)
    match = _LOADED.search(log_path.read_text())
    return ready, float(match.group(1)) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF directory or GGUF file (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--container", help="the .ninfer to compare (default: <out>/model.ninfer, packed here)")
    parser.add_argument("--pack-args", default="", help="extra `ninfer pack` arguments, e.g. '--weights fp8'")
    parser.add_argument("--serve-command", default=f"{sys.executable} -m ninfer.cli serve")
    parser.add_argument("--server-args", default="", help="the same for both servers")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8311)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    parser.add_argument("--out", default="startup")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from ninfer.artifact import default_model_path

        args.model = str(default_model_path())
    container = Path(args.container or out / "model.ninfer")
    pack_seconds = None
    if not container.exists():
        command = [sys.executable, "-m", "ninfer.cli", "pack", args.model, str(container), *shlex.split(args.pack_args)]
        print(f"$ {shlex.join(command)}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True)
        pack_seconds = time.perf_counter() - started
    serve = shlex.split(args.serve_command)
    extra = shlex.split(args.server_args)
    artifacts = {"source": args.model, "container": str(container)}
    samples: dict[str, list[tuple[float, float | None]]] = {name: [] for name in artifacts}
    for run in range(args.runs):
        for name, path in artifacts.items():
            ready, loaded = time_to_ready([*serve, path, *extra], args.port, out / f"{name}-{run}.log", args.timeout)
            samples[name].append((ready, loaded))
            print(f"  run {run + 1} {name}: ready in {ready:.2f} s (model loaded in {loaded} s)", file=sys.stderr)
    summary = {}
    for name, values in samples.items():
        loads = [loaded for _, loaded in values if loaded is not None]
        summary[name] = {
            "path": artifacts[name],
            "ready_seconds": [ready for ready, _ in values],
            "median_ready_seconds": statistics.median(ready for ready, _ in values),
            "median_model_loaded_seconds": statistics.median(loads) if loads else None,
        }
    ratio = summary["source"]["median_ready_seconds"] / summary["container"]["median_ready_seconds"]
    results = {"server_args": args.server_args, "pack_seconds": pack_seconds, "runs": args.runs,
               "artifacts": summary, "ready_speedup": ratio}
    (out / "startup.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"ninfer-serve start-up to /health ready, median of {args.runs} alternating runs "
        f"(server args: `{args.server_args or 'defaults'}`){f'; packing took {pack_seconds:.1f} s' if pack_seconds else ''}.",
        "",
        "| artifact | ready (s) | model loaded (s, engine log) |",
        "|---|---|---|",
    ]
    for name, row in summary.items():
        loaded = row["median_model_loaded_seconds"]
        lines.append(f"| {name}: `{row['path']}` | {row['median_ready_seconds']:.2f} | "
                     f"{'–' if loaded is None else f'{loaded:.2f}'} |")
    lines += ["", f"The container is ready {ratio:.2f}x sooner."]
    (out / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
