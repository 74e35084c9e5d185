"""The chat page at / in a real browser: Debian's Chromium, headless, driven by Selenium, against a real
server on a loopback socket behind --api-key with a request log.

The model is scripted: by the user's last words it answers with reasoning and a tool call, with
Markdown that carries hostile HTML, or slowly (so the page can stop it), and after a tool result it
answers. Every browser test also checks that the page logged no console error and that no request
left the server's origin.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import shutil
import time
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest
from PIL import Image
from starlette.testclient import TestClient

from ninfer.cli import add_serve_options, serve_config as cli_serve_config
from ninfer.engine.core import EngineCore
from ninfer.server.api_process import build_serving
from ninfer.server.http_app import create_app
from ninfer.server.served_model import ServedModel
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.scripted_model import ScriptedLM
from tests.server.conftest import RunningServer, serve_config, start_server, wait_until

KEY = "page-test-key"
REPO = Path(__file__).resolve().parents[2]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
# The scripts, chosen by a keyword of the user's message (or a tool result at the prompt's end).
TOOL_CALL, AFTER_TOOL, MARKDOWN, SLOW = range(4)
SCRIPTS = {
    TOOL_CALL: "The user wants weather.\n</think>\n\nLet me check **now**.\n\n<tool_call>\n<function=get_weather>\n"
               "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    AFTER_TOOL: "The tool answered.\n</think>\n\nIt is sunny in Paris.",
    MARKDOWN: "Formatting.\n</think>\n\n## Result\n\n<img src=x onerror=\"document.title='pwned'\">"
              "<script>document.title='pwned'</script>\n\n```python\nprint('<b>hi</b>')\n```\n\n"
              "| city | sky |\n|---|---|\n| Paris | *sunny* |\n\n[click](javascript:document.title='pwned')",
    SLOW: "Taking my time. " * 8 + "\n</think>\n\n" + "word " * 400,
}
KEYWORDS = {"weather": TOOL_CALL, "markdown": MARKDOWN, "slowly": SLOW}
SLOW_STEP_S = 0.04
CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800")


class PacedScriptedLM(ScriptedLM):
    """The slow script takes SLOW_STEP_S per step, so it is still decoding when the page stops it."""

    def forward(self, input_ids, batch):
        out = super().forward(input_ids, batch)
        if bool((out[:, 1] == SLOW).any()):
            time.sleep(SLOW_STEP_S)
        return out


def page_server(artifact: str, request_log: Path) -> RunningServer:
    config = serve_config(artifact, api_key=KEY, request_log_jsonl=str(request_log), max_context=4096,
                          prefill_chunk=256, default_max_tokens=600)

    def build(serving: ServedModel) -> EngineCore:
        tokenizer = serving.artifact.tokenizer
        chosen = [MARKDOWN]

        def choose(chunk: list[int]) -> int:
            # The prompt's last chunk may hold only the generation prompt (chunks end at cache
            # checkpoints), so the latest keyword or tool result of any chunk decides; tests run one at a time.
            text = tokenizer.decode(chunk).lower()
            signals = {**KEYWORDS, "</tool_response>": AFTER_TOOL}
            found = [(text.rfind(word), script) for word, script in signals.items() if word in text]
            if found:
                chosen[0] = max(found)[1]
            return chosen[0]

        scripts = [tokenizer.encode(SCRIPTS[i]) for i in range(len(SCRIPTS))]
        end = tokenizer.token_to_id("<|im_end|>")
        model = PacedScriptedLM(serving.artifact.config.vocab_size, scripts, end, choose)
        return EngineCore(model, tokenizer, config.engine)

    return start_server(config, build)


def chromium(download_dir: Path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="Selenium is not installed: run "
                                    "`bash scripts/install.sh --test`")
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or "/usr/bin/chromium"
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    for path, package in ((binary, "chromium"), (driver_path, "chromium-driver")):
        if not Path(path).exists():
            pytest.skip(f"{path} is missing: `bash scripts/install.sh --test` installs Debian's {package} (as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in CHROMIUM_ARGS:
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    options.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                              "download.prompt_for_download": False})
    # An explicit driver path: Selenium's own manager would try to download one.
    return webdriver.Chrome(service=Service(driver_path), options=options)


@pytest.fixture(scope="module")
def request_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("web-ui-log") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(tiny_qwen, request_log) -> Iterator[RunningServer]:
    running = page_server(tiny_qwen, request_log)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("web-ui-downloads")


@pytest.fixture(scope="module")
def browser(downloads):
    driver = chromium(downloads)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def clean_page(request):
    """After each browser test: no console error, no request to anywhere but the server."""
    yield
    driver, server = request.node.funcargs.get("browser"), request.node.funcargs.get("server")
    if driver is None or server is None:  # not a browser test, or one skipped for want of a browser
        return
    origin = server.base_url
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    assert not foreign_requests(driver, origin)


def foreign_requests(driver, origin: str) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return [url for url in urls if not url.startswith((origin + "/", "data:", "blob:"))]


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def open_page(driver, server: RunningServer, key: str | None = KEY, settings: dict | None = None,
              ready: bool = True) -> None:
    """The page on a fresh browser state: the key (and settings) as the page itself would have stored them."""
    driver.get(server.base_url + "/ui/icon.svg")  # the origin, without the page's requests
    js(driver, "localStorage.clear();")
    if key is not None:
        js(driver, "localStorage.setItem('ninfer.apiKey', JSON.stringify(arguments[0]));", key)
    if settings is not None:
        js(driver, "localStorage.setItem('ninfer.settings', JSON.stringify(arguments[0]));", settings)
    driver.get(server.base_url + "/")
    if ready:
            wait_until(lambda: js(driver, "return document.getElementById('model-name').textContent")
                   == server.serving.model_id, what="the model's id on the page")


def by_id(driver, element_id: str):
    return driver.find_element("id", element_id)


def send(driver, text: str) -> None:
    """Type a message and press Enter; wait for the answer to finish (or stop)."""
    count = len(driver.find_elements("css selector", ".message.assistant"))
    by_id(driver, "input").send_keys(text + "\n")
    wait_until(lambda: len(driver.find_elements("css selector", ".message.assistant")) == count + 1,
               what="the answer's message")
    wait_until(lambda: last_answer(driver)["state"] != "streaming", what="the end of the answer")


def last_answer(driver) -> dict:
    return js(driver, """
        const answer = [...document.querySelectorAll('.message.assistant')].pop();
        const details = answer.querySelector('.reasoning:not([hidden])');
        return {
          state: answer.dataset.state,
          content: answer.querySelector('.content').innerText,
          html: answer.querySelector('.content').innerHTML,
          reasoning: details ? details.querySelector('.reasoning-body').textContent : null,
          reasoning_open: details ? details.open : null,
          tool_calls: [...answer.querySelectorAll('.tool-call')].map(c => c.innerText),
          timings: Object.fromEntries([...answer.querySelectorAll('[data-timing]')]
                                      .map(t => [t.dataset.timing, t.textContent])),
          note: answer.querySelector('.note')?.textContent ?? null,
        };""")


def request_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the page, its key and its files -------------------------------------------------------------


def test_the_page_asks_for_the_key_and_keeps_it(browser, server):
    open_page(browser, server, key="wrong-key", ready=False)
    wait_until(lambda: by_id(browser, "key-error").text, what="the key prompt")
    dialog = by_id(browser, "key-dialog")
    assert dialog.is_displayed() and "refused" in by_id(browser, "key-error").text
    by_id(browser, "key-input").send_keys(KEY + "\n")
    wait_until(lambda: by_id(browser, "model-name").text == server.serving.model_id, what="the model's id")
    assert not dialog.is_displayed()
    assert js(browser, "return JSON.parse(localStorage.getItem('ninfer.apiKey'))") == KEY
    refused = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert refused and all("/v1/models" in entry["message"] and "401" in entry["message"] for entry in refused)
    browser.refresh()  # the kept key opens the page directly
    wait_until(lambda: by_id(browser, "model-name").text == server.serving.model_id, what="the model's id")
    assert not by_id(browser, "key-dialog").is_displayed()


def test_the_page_and_its_files_need_no_key_and_the_api_still_does(server):
    page = httpx.get(server.base_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for name in ("app.js", "markdown.js", "chat_stream.js", "storage.js", "style.css", "icon.svg"):
        assert httpx.get(f"{server.base_url}/ui/{name}").status_code == 200, name
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    missing = httpx.get(server.base_url + "/ui/secret.py")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"


def test_the_models_card_tells_the_page_what_the_server_can_do(server):
    card = httpx.get(server.base_url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert card["capabilities"] == {"vision": False, "tools": True, "thinking_default": True, "thinking_switch": True}


# ---- conversations -------------------------------------------------------------------------------


def test_reasoning_a_tool_call_its_result_and_the_timings_render(browser, server):
    open_page(browser, server)
    assert not by_id(browser, "attach").is_displayed()  # no --vision
    by_id(browser, "open-settings").click()
    by_id(browser, "set-tools").send_keys(json.dumps([WEATHER_TOOL]))
    browser.find_element("css selector", "#settings-form button[type=submit]").click()
    assert not by_id(browser, "settings-dialog").is_displayed()

    send(browser, "What is the weather in Paris?")
    answer = last_answer(browser)
    assert answer["state"] == "done" and answer["reasoning"].strip() == "The user wants weather."
    assert answer["reasoning_open"] is False  # folded once the answer began
    assert answer["content"].strip() == "Let me check now." and "<strong>now</strong>" in answer["html"]
    (call,) = answer["tool_calls"]
    assert "get_weather" in call and json.loads(call[call.index("{"):]) == {"city": "Paris", "days": 3}
    assert "tok/s" in answer["timings"]["prompt"] and "tok/s" in answer["timings"]["decode"]
    assert by_id(browser, "pending-tool").is_displayed()

    send(browser, "Sunny, 24 C")  # the tool's result
    answer = last_answer(browser)
    assert answer["content"].strip() == "It is sunny in Paris." and not answer["tool_calls"]
    cached = int(answer["timings"]["cached"].split()[1])
    assert cached > 0  # the conversation's prefix was reused, and the page shows it
    assert not by_id(browser, "pending-tool").is_displayed()


def test_model_output_cannot_inject_markup(browser, server):
    open_page(browser, server)
    send(browser, "Show some markdown")
    answer = last_answer(browser)
    assert "<img src=x" in answer["content"] and "<script>" in answer["content"]  # shown as text
    assert js(browser, "return document.querySelectorAll('.message img, .message script').length") == 0
    assert js(browser, "return document.querySelector('.message.assistant .content a')") is None
    assert browser.title != "pwned"
    assert js(browser, "return document.querySelector('.message.assistant h2').textContent") == "Result"
    assert js(browser, "return document.querySelector('.code-block code').textContent") == "print('<b>hi</b>')"
    assert js(browser, "return document.querySelector('.message.assistant td em').textContent") == "sunny"


def test_an_answer_streams_in_and_stop_cancels_it_in_the_server(browser, server, request_log):
    open_page(browser, server)
    by_id(browser, "input").send_keys("Answer slowly please\n")
    # The reasoning streams into an open block while the model thinks...
    thought = """const answer = [...document.querySelectorAll('.message.assistant')].pop();
                 const block = answer?.querySelector('.reasoning:not([hidden])');
                 return block?.open && answer.dataset.state === 'streaming'
                        ? block.querySelector('.reasoning-body').textContent.length : 0"""
    wait_until(lambda: js(browser, thought) > 0, what="the reasoning")
    seen = js(browser, thought)
    wait_until(lambda: js(browser, thought) > seen, what="more reasoning")
    # ...then the answer streams in, the reasoning folded.
    words = "return [...document.querySelectorAll('.message.assistant .content')].pop()?.innerText.length ?? 0"
    wait_until(lambda: js(browser, words) > 20, what="the first words")
    seen = js(browser, words)
    wait_until(lambda: js(browser, words) > seen, what="more words")
    answer = last_answer(browser)
    assert answer["state"] == "streaming" and answer["reasoning_open"] is False
    assert "tok/s" in answer["timings"]["decode"]  # the running speed
    by_id(browser, "stop").click()
    wait_until(lambda: last_answer(browser)["state"] == "stopped", what="the stopped answer")
    answer = last_answer(browser)
    assert answer["note"] == "Stopped" and len(answer["content"]) < len(SCRIPTS[SLOW]) - 400
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    # Closing the connection cancelled the request in the engine: the request log says so.
    wait_until(lambda: any(e["event"] == "request_error" and e["phase"] == "cancelled"
                           for e in request_events(request_log)), what="the cancellation record")
    wait_until(lambda: server.core.pool_accounting()["running"] == 0, what="the freed lane")


def test_settings_reach_the_request(browser, server):
    settings = {"thinking": False, "temperature": "0.3", "maxTokens": "4", "system": "Be brief.", "tools": ""}
    open_page(browser, server, settings=settings)
    js(browser, """
        window.sentBodies = [];
        const fetch = window.fetch;
        window.fetch = (url, init) => { if (init?.body) window.sentBodies.push(JSON.parse(init.body));
                                        return fetch(url, init); };""")
    send(browser, "Show markdown")
    (body,) = js(browser, "return window.sentBodies")
    assert (body["enable_thinking"], body["temperature"], body["max_tokens"]) == (False, 0.3, 4)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."} and body["stream"] is True
    answer = last_answer(browser)
    assert answer["note"] == "Stopped at the output limit" and answer["reasoning"] is None
    assert answer["timings"]["decode"].startswith("Decode 4 tok")


def test_conversations_stay_in_the_browser_and_export_as_json(browser, server, downloads):
    open_page(browser, server)
    send(browser, "Some markdown again")
    send(browser, "And more markdown")
    browser.refresh()
    wait_until(lambda: len(browser.find_elements("css selector", ".message")) == 4, what="the kept conversation")
    assert browser.find_element("css selector", "#conversation-list li.current").text.startswith("Some markdown again")
    by_id(browser, "export").click()
    wait_until(lambda: [p for p in downloads.glob("ninfer-conversations-*.json")], what="the export")
    (exported,) = downloads.glob("ninfer-conversations-*.json")
    data = json.loads(exported.read_text())
    (conversation,) = data["conversations"]
    roles = [message["role"] for message in conversation["messages"]]
    assert data["format"] == "ninfer-conversations" and roles == ["user", "assistant"] * 2
    assert conversation["messages"][1]["timings"]["predicted_n"] > 0


def test_a_narrow_window_and_the_keyboard(browser, server):
    from selenium.webdriver.common.keys import Keys

    browser.set_window_size(390, 800)
    try:
        open_page(browser, server)
        send(browser, "Markdown on a phone")
        overflow = "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        assert js(browser, overflow) <= 0
        sidebar = by_id(browser, "sidebar")
        assert not sidebar.is_displayed() and by_id(browser, "input").is_displayed()
        by_id(browser, "toggle-sidebar").click()
        wait_until(sidebar.is_displayed, what="the sidebar")
        by_id(browser, "new-chat").send_keys("\n")  # Enter on the focused button: a new conversation
        wait_until(lambda: not sidebar.is_displayed(), what="the sidebar to close")
        assert js(browser, "return document.querySelectorAll('.message').length") == 0
        assert js(browser, "return document.activeElement.id") == "input"
        by_id(browser, "input").send_keys("line one")
        # Shift+Enter: a new line, not sent.
        by_id(browser, "input").send_keys(Keys.SHIFT, Keys.ENTER, Keys.NULL, "line two")
        assert by_id(browser, "input").get_property("value") == "line one\nline two"
        assert js(browser, "return document.querySelectorAll('.message').length") == 0
    finally:
        browser.set_window_size(1100, 800)


# ---- images (--vision) ---------------------------------------------------------------------------


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (300, 260), (40, 120, 200)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


PASTE = """
    const [url] = arguments;
    const bytes = Uint8Array.from(atob(url.split(',')[1]), c => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], 'pasted.png', {type: 'image/png'}));
    document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true}));
"""


def test_a_pasted_image_without_vision_is_refused_in_the_page(browser, server):
    open_page(browser, server)
    js(browser, PASTE, png_data_url())
    wait_until(lambda: by_id(browser, "toast").is_displayed(), what="the notice")
    assert "--vision" in by_id(browser, "toast").text
    assert js(browser, "return document.querySelectorAll('.attachment').length") == 0


def test_an_image_pasted_on_a_vision_server_goes_with_the_message(browser, server, artifact_root, tmp_path):
    # A second, real server: the tiny VL model (random weights) runs the vision tower on the image.
    vl = str(make_tiny_qwen3_5(artifact_root, vision=True))
    vision = start_server(serve_config(vl, vision=True, default_max_tokens=4, max_context=2048))
    try:
        vision_origin = vision.base_url
        open_page(browser, vision, key=None)
        assert by_id(browser, "attach").is_displayed()
        js(browser, PASTE, png_data_url())
        wait_until(lambda: js(browser, "return document.querySelectorAll('.attachment img').length") == 1,
                   what="the image's preview")
        send(browser, "What is in this image?")
        answer = last_answer(browser)
        assert answer["state"] == "done", answer
        assert js(browser, "return document.querySelectorAll('.message.user .images img').length") == 1
        prompt_tokens = int(answer["timings"]["prompt"].split()[1])
        assert prompt_tokens > 72  # the image's 72 vision tokens and the text
        errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors and not foreign_requests(browser, vision_origin)
    finally:
        vision.stop()


# ---- --no-web-ui and packaging -------------------------------------------------------------------


def test_without_the_page_the_root_is_the_protocols_404_again(tiny_qwen):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    serving = build_serving(serve_config(tiny_qwen))  # the engine is never started

    def app_for(*flags: str) -> TestClient:
        config, _ = cli_serve_config(parser.parse_args([tiny_qwen, *flags]))
        return TestClient(create_app(dataclasses.replace(serving, config=config)))

    client = app_for("--no-web-ui")
    root, unknown = client.get("/"), client.get("/no-such-path")
    assert root.status_code == unknown.status_code == 404
    assert root.json() == {"error": {"message": "GET /: Not Found", "type": "not_found_error", "param": None,
                                     "code": "not_found"}}
    assert root.json()["error"].keys() == unknown.json()["error"].keys()
    assert client.get("/ui/app.js").status_code == 404
    assert app_for("--no-web-ui", "--api-key", KEY).get("/").status_code == 401  # as before the page existed
    served = app_for()
    assert served.get("/").status_code == 200 and served.head("/").status_code == 200


def test_the_help_lists_the_option():
    import argparse

    parser = argparse.ArgumentParser(prog="ninfer-serve")
    add_serve_options(parser)
    assert "--no-web-ui" in parser.format_help()


def test_every_page_file_is_package_data():
    """A non-editable install carries only declared package data: every file the page serves is declared."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = declared["ninfer.server.web_ui"]
    files = [p.name for p in (REPO / "ninfer/server/web_ui").iterdir() if p.suffix in (".html", ".js", ".css", ".svg")]
    assert "index.html" in files
    assert all(any(fnmatch(name, pattern) for pattern in patterns) for name in files)
