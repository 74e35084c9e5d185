"""Claude Code 2.1 (Anthropic Messages) completes tool-using sessions against ninfer-serve as shipped.

Its default settings exercise the compatibility rules on every request: thinking adaptive with
display "omitted" (the reasoning travels in the signature and comes back on replay), an
output_config.effort the template lacks, a deferred tool, a mid-conversation system message,
the billing-header system block and three cache_control breakpoints.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.clients.conftest import FINAL_ANSWER, MARKER_FILE, TOOL_OUTPUT, agent_server, client_binary

pytestmark = pytest.mark.slow


def run_claude(claude: str, base_url: str, home, work, *args: str) -> dict:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-local",
        "ANTHROPIC_MODEL": "ninfer-local",
        # No update checks, telemetry or other traffic beyond the server under test.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    result = subprocess.run(
        [claude, "-p", *args, "--allowedTools", "Bash", "--output-format", "json"],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
    return json.loads(result.stdout)


def test_a_tool_session_and_its_continuation(agent_artifact, workspace):
    claude = client_binary("claude")
    home, work = workspace
    command = f"touch {MARKER_FILE} && echo {TOOL_OUTPUT}"
    server = agent_server(agent_artifact, "Bash", {"command": command, "description": "Create a marker file"})
    try:
        first = run_claude(claude, server.base_url, home, work, "Run the command and report its output.")
        # The model called Bash, Claude Code ran it, and the answer came after the tool result.
        assert (work / MARKER_FILE).exists()
        assert (first["result"], first["num_turns"], first["is_error"]) == (FINAL_ANSWER, 2, False)
        # The second request of the turn re-read the first one's prompt from the cache.
        assert first["usage"]["cache_read_input_tokens"] > 0

        (work / MARKER_FILE).unlink()
        second = run_claude(claude, server.base_url, home, work, "--continue", "Now run it again.")
        assert (work / MARKER_FILE).exists()
        assert (second["result"], second["num_turns"]) == (FINAL_ANSWER, 2)
        assert server.core.pool_accounting()["running"] == 0
    finally:
        server.stop()
