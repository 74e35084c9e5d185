"""Takes the README's picture of the chat page (docs/chat-page.png): ninfer-serve on the embedded
model on the CPU, a short conversation typed into headless Chromium, the finished page saved as PNG.

    python3 scripts/chat_page_screenshot.py [--out docs/chat-page.png]

Needs the test set-up (`bash scripts/install.sh --test`: Selenium, Debian's chromium and chromium-driver).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string, with a short explanation.",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/chat-page.png")
    parser.add_argument("--size", default="1100,760", help="browser window, W,H")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # A fixed seed, so the picture shows the same answer each time it is taken; short answers, so it fits.
    server = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--port", str(port), "--seed", "0",
                               "--default-max-tokens", "200", "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, start_new_session=True)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={args.size}",
                     "--force-color-profile=srgb", "--hide-scrollbars"):
        options.add_argument(argument)
    driver = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.get(base + "/")
        while driver.find_element("id", "model-name").text == "NInfer":  # until it has read /v1/models
            time.sleep(0.1)
        for prompt in PROMPTS:
            driver.find_element("id", "input").send_keys(prompt + "\n")
            time.sleep(0.5)
            deadline = time.monotonic() + 300
            while driver.find_elements("css selector", '.message.assistant[data-state="streaming"]'):
                if time.monotonic() > deadline:
                    raise SystemExit("the answer did not finish in 300 s")
                time.sleep(0.2)
        time.sleep(0.5)
        # A palette PNG: the page's few flat colours keep text sharp at a fraction of the size.
        image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
        image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(args.out, optimize=True)
        print(f"{args.out}: {os.path.getsize(args.out) // 1024} KiB")
    finally:
        if driver is not None:
            driver.quit()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
