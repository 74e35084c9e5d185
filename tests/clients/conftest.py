"""Real agent clients (Claude Code, Codex CLI) against a real ninfer-serve socket.

The clients are the npm packages pinned in tests/clients/package.json, installed by
`scripts/install.sh --test`. The model behind the server is scripted like an agent: it calls
the client's shell tool, and once the tool's result is in the prompt it answers. It computes
nothing, so the clients' real prompts (tens of thousands of characters of instructions and
tool schemas) cost no prefill time, while every protocol detail goes through the real server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ninfer.engine.core import EngineCore
from ninfer.server.served_model import ServedModel
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.scripted_model import ScriptedLM
from tests.server.conftest import RunningServer, serve_config, start_server

CLIENTS = Path(__file__).parent / "node_modules" / ".bin"
MARKER_FILE = "created-by-agent.txt"
TOOL_OUTPUT = "hello-from-tool"
FINAL_ANSWER = f"DONE: the command printed {TOOL_OUTPUT}."
# How many trailing prompt tokens may follow a tool result: its close tag, the turn end, the
# assistant opener and the open think block.
TAIL_AFTER_RESULT = 24


def client_binary(name: str) -> str:
    path = CLIENTS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: run `bash scripts/install.sh --test` (needs npm)")
    return str(path)


def tool_call_script(function: str, arguments: dict[str, str]) -> str:
    """Qwen's XML tool-call markup after a short reasoning, as the tiny Qwen3.5 template expects."""
    parameters = "".join(f"<parameter={name}>\n{value}\n</parameter>\n" for name, value in arguments.items())
    return f"I will run the command.\n</think>\n\n<tool_call>\n<function={function}>\n{parameters}</function>\n</tool_call>"


def agent_server(artifact: str, function: str, arguments: dict[str, str]) -> RunningServer:
    """A server whose model calls `function` unless the prompt ends with a tool result, then answers."""
    config = serve_config(artifact, max_context=65536, prefill_chunk=8192, max_concurrency=2, log_stats_interval_ms=0)

    def build(serving: ServedModel) -> EngineCore:
        tokenizer = serving.artifact.tokenizer
        result_close = tokenizer.token_to_id("</tool_response>")
        scripts = [
            tokenizer.encode(tool_call_script(function, arguments)),
            tokenizer.encode(f"The tool answered.\n</think>\n\n{FINAL_ANSWER}"),
        ]

        def choose(chunk: list[int]) -> int:
            return 1 if result_close in chunk[-TAIL_AFTER_RESULT:] else 0

        model = ScriptedLM(serving.artifact.config.vocab_size, scripts, tokenizer.token_to_id("<|im_end|>"), choose)
        return EngineCore(model, tokenizer, config.engine)

    return start_server(config, build)


@pytest.fixture(scope="session")
def agent_artifact(tmp_path_factory) -> str:
    return str(make_tiny_qwen3_5(str(tmp_path_factory.mktemp("agent-artifacts")), template="qwen3_5"))


@pytest.fixture
def workspace(tmp_path) -> Iterator[tuple[Path, Path]]:
    """(home, work): an empty HOME and a git repository to work in, as a user's would be."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    git = shutil.which("git")
    if git:
        env = {**os.environ, "HOME": str(home)}
        subprocess.run([git, "init", "-q"], cwd=work, check=True, env=env)
        (work / "README.md").write_text("A project.\n")
    yield home, work
