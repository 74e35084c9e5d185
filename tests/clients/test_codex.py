"""Codex CLI 0.171 (OpenAI Responses) completes tool-using sessions against ninfer-serve as shipped.

With a model name it has no metadata for (the case of every local model) Codex sends function
tools plus a hosted web_search tool, store:false with the full history each turn, and
include ["reasoning.encrypted_content"]; `exec resume` replays reasoning Items with their
content and encrypted_content. All of it goes through the compatibility rules unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.clients.conftest import FINAL_ANSWER, MARKER_FILE, TOOL_OUTPUT, agent_server, client_binary

pytestmark = pytest.mark.slow


def codex_config(model: str, base_url: str) -> str:
    return f"""model = "{model}"
model_provider = "ninfer"
approval_policy = "never"
sandbox_mode = "workspace-write"

[analytics]
enabled = false

[features]
plugins = false

[model_providers.ninfer]
name = "NInfer"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "NINFER_API_KEY"
"""


def run_codex(codex: str, home, work, *args: str) -> list[dict]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "CODEX_HOME": str(home / ".codex"),
        "NINFER_API_KEY": "sk-local",
    }
    result = subprocess.run(
        [codex, "exec", "--skip-git-repo-check", "--json", *args],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def completed(events: list[dict], kind: str) -> list[dict]:
    return [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind]


def test_a_tool_session_and_its_resumption(agent_artifact, workspace):
    codex = client_binary("codex")
    home, work = workspace
    command = f"touch {MARKER_FILE} && echo {TOOL_OUTPUT}"
    server = agent_server(agent_artifact, "exec_command", {"cmd": command})
    try:
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(codex_config(server.serving.model_id, server.base_url))
        first = run_codex(codex, home, work, "Run the command and report its output.")
        (ran,) = completed(first, "command_execution")
        assert (ran["exit_code"], ran["aggregated_output"]) == (0, TOOL_OUTPUT + "\n")
        assert (work / MARKER_FILE).exists()
        assert [m["text"] for m in completed(first, "agent_message")] == [FINAL_ANSWER]
        (usage,) = [e["usage"] for e in first if e["type"] == "turn.completed"]
        assert 0 < usage["cached_input_tokens"] < usage["input_tokens"]  # the turn's second request hit

        (work / MARKER_FILE).unlink()
        second = run_codex(codex, home, work, "resume", "--last", "Now run it again.")
        assert (work / MARKER_FILE).exists()
        assert [m["text"] for m in completed(second, "agent_message")] == [FINAL_ANSWER]
        assert server.core.pool_accounting()["running"] == 0
    finally:
        server.stop()
