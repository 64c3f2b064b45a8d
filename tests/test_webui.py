"""The chat page at `/` in headless Chromium (Debian's `chromium`, driven by Playwright for Python, no browser
download): end to end against `flashdraft serve` on tiny random models (slow), and its rendering of a canned
answer with no server at all (fast).

Skipped when /usr/bin/chromium or the playwright package is missing. Set FLASHDRAFT_WEBUI_SCREENSHOT=docs/webui.png
to write the README's screenshot; otherwise it goes to the test's temporary folder.
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[1]
WEBUI = ROOT / "flashdraft" / "server" / "webui"
CONVS = "flashdraft.conversations.v1"  # the page's localStorage key


def get_json(url: str) -> dict | list:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed "
                                                                  "(pip install playwright)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):
    """`flashdraft serve` on a tiny target and DFlash draft; non-default sampling defaults so the page's
    settings visibly come from /props."""
    from tiny import make_draft, make_target
    root = tmp_path_factory.mktemp("webui")
    target = make_target(root / "tiny-target")
    draft = make_draft(root / "tiny-draft", target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = root / "serve.log"
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve", "-m", str(target), "-md", str(draft), "--port", str(port),
           "--device", "cpu", "--ctx-size", "1024", "--temp", "0.5", "--top-k", "20"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"flashdraft serve exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                get_json(url + "/health")
                break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"flashdraft serve did not become healthy:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def open_page(browser, url: str, setup=None):
    ctx = browser.new_context(viewport={"width": 1180, "height": 760})
    pg = ctx.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    if setup:
        setup(ctx)
    pg.goto(url + "/")
    pg.wait_for_selector("#health.ok")
    return pg


@pytest.fixture
def page(browser, server):
    pg = open_page(browser, server)
    yield pg
    assert pg.errors == [], pg.errors
    pg.context.close()


def set_setting(page, key: str, value) -> None:
    page.click("#open-settings")
    page.fill(f"#set-{key}", str(value))
    page.click("#close-settings")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_answer(page, n: int, timeout: float = 90_000) -> None:
    """Wait until the n-th answer (1-based) has finished streaming."""
    page.wait_for_function(
        "n => { const a = document.querySelectorAll('.msg.assistant'); "
        "return a.length >= n && !a[n - 1].classList.contains('streaming') && !document.querySelector('#send').hidden; }",
        arg=n, timeout=timeout)


def stored_messages(page) -> list[dict]:
    convs = page.evaluate(f"JSON.parse(localStorage.getItem('{CONVS}'))")
    assert len(convs) == 1
    return convs[0]["messages"]


@pytest.mark.slow  # two models, a server, a browser and four streamed answers: 30-90 s on two CPU cores
def test_chat_streams_with_statistics_stops_and_survives_reload(page, server, tmp_path):
    props = get_json(server + "/props")
    # header: model, draft, health
    assert page.inner_text("#model-name") == props["model_alias"] == "tiny-target"
    assert page.inner_text("#draft-name") == "tiny-draft \u00b7 DFlash block 8"
    assert page.inner_text("#health-text") == "ready"
    # settings start from the server's defaults
    page.click("#open-settings")
    assert page.input_value("#set-temperature") == "0.5" and page.input_value("#set-top_k") == "20"
    assert page.input_value("#set-max_tokens") == "-1" and page.input_value("#set-reasoning") == "auto"
    page.click("#close-settings")
    set_setting(page, "max_tokens", 12)

    # 1. an answer streams in and ends with the server's statistics under it
    send(page, "Write a Python function that adds two numbers")
    wait_answer(page, 1)
    m = stored_messages(page)[1]
    t, spec = m["stats"]["timings"], m["stats"]["speculative"]
    assert m["status"] == "done" and m["content"] and 0 < t["predicted_n"] <= 12
    stats = page.inner_text(".msg.assistant .stats")
    assert f"{t['predicted_per_second']:.1f} tok/s" in stats
    assert f"prompt {t['prompt_n']} tok \u00b7 {t['prompt_per_second']:.1f} tok/s" in stats
    assert f"{t['predicted_n']} tokens" in stats
    assert f"accept len {spec['mean_acceptance_length']:.2f}" in stats
    assert f"accepted {100 * spec['acceptance_rate']:.1f}%" in stats
    hist = spec["acceptance_histogram"]
    assert len(hist) == 9 and sum(hist) == spec["verify_steps"] > 0
    assert page.locator(".msg.assistant .stat-hist rect.bar").count() == len(hist) - (hist[0] == 0)
    assert page.locator(".msg.assistant .content.answer").inner_text().strip()

    # 2. a long answer (the request is made to ignore EOS) shows live statistics and stops on Stop
    def ignore_eos(route):
        body = json.loads(route.request.post_data)
        assert body["stream"] and body["max_tokens"] == 900 and body["temperature"] == 0.5
        route.continue_(post_data=json.dumps(body | {"ignore_eos": True}))
    page.route("**/v1/chat/completions", ignore_eos)
    set_setting(page, "max_tokens", 900)
    send(page, "Now explain speculative decoding at length")
    live = ".msg.assistant.streaming .stats"
    page.wait_for_function(f"() => +(document.querySelector('{live} .stat-completion b') || {{}}).textContent >= 4",
                           timeout=60_000)
    live_text = page.inner_text(live)
    assert "live" in live_text and "tok/s" in live_text and "accept len" in live_text
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.click("#stop")
    wait_answer(page, 2, timeout=10_000)
    page.unroute("**/v1/chat/completions")
    answer = page.locator(".msg.assistant").nth(1)
    assert answer.locator(".badge.stopped").count() == 1
    text = answer.locator(".content.answer").inner_text()
    time.sleep(0.5)
    assert answer.locator(".content.answer").inner_text() == text  # nothing arrives after Stop
    m = stored_messages(page)[3]
    assert m["status"] == "stopped" and m["content"] and m["stats"]["live"]["n"] >= 4
    # the server noticed the disconnect and freed its slot; the next message is answered
    deadline = time.monotonic() + 15
    while any(s["is_processing"] for s in get_json(server + "/slots")):
        assert time.monotonic() < deadline, "the slot is still busy after Stop"
        time.sleep(0.1)
    set_setting(page, "max_tokens", 4)
    send(page, "In *one* line, please")
    wait_answer(page, 3)
    assert stored_messages(page)[5]["status"] == "done"
    first_stats = page.inner_text(".msg.assistant .stats")

    # 3. after a reload the conversation is in the list and opens with its answers and statistics
    page.reload()
    page.wait_for_selector("#health.ok")
    assert page.locator("#conv-list .conv").all_inner_texts() == ["Write a Python function that adds two numbers\n\u00d7"]
    assert page.locator(".msg").count() == 6
    assert page.inner_text(".msg.assistant .stats") == first_stats
    assert page.locator(".msg.assistant .badge.stopped").count() == 1
    assert page.locator(".msg.user .bubble").nth(2).inner_text() == "In *one* line, please"  # not Markdown
    shot = Path(os.environ.get("FLASHDRAFT_WEBUI_SCREENSHOT") or tmp_path / "webui.png")
    shot = shot if shot.is_absolute() else ROOT / shot
    page.locator("#messages").evaluate("el => el.scrollTop = 0")
    page.screenshot(path=str(shot))
    assert shot.stat().st_size < 300_000

    # 4. new chat, switching and deleting
    page.click("#new-chat")
    assert page.locator(".welcome").count() == 1
    page.click("#conv-list .conv .title")
    assert page.locator(".msg").count() == 6
    page.click("#conv-list .conv .del")
    assert page.locator("#conv-list .conv").count() == 0 and page.locator(".welcome").count() == 1
    assert page.evaluate(f"JSON.parse(localStorage.getItem('{CONVS}'))") == []


@pytest.mark.slow
def test_errors_are_shown_readably(page, server):
    # the prompt does not fit in the context: the server's own message
    send(page, "hello " * 1500)
    box = page.wait_for_selector(".msg.assistant .error-box:not([hidden])", timeout=30_000)
    text = box.inner_text()
    assert "Server error 400 \u00b7 exceed_context_size_error" in text and "exceeds the available context size" in text
    # a bad setting: the server rejects it and says why
    set_setting(page, "top_p", 5)
    send(page, "hi")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .error-box:not([hidden])').length == 2")
    assert "top_p" in page.locator(".msg.assistant .error-box").nth(1).inner_text()
    page.click("#open-settings")
    page.click("#reset-settings")
    assert page.input_value("#set-top_p") == "0.95"
    page.click("#close-settings")
    # the server is down: requests fail at the network level
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    page.route("**/health", lambda route: route.abort("connectionrefused"))
    send(page, "anyone there?")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .error-box:not([hidden])').length == 3")
    assert "Server unreachable" in page.locator(".msg.assistant .error-box").nth(2).inner_text()
    assert page.inner_text("#health-text") == "server down"
    assert page.is_visible("#send")


CANNED = """Here is **bold**, `code` and a [link](https://example.com/?a=1&b=2).

```python
def add(a, b):
    return a + b  # "sum"
```

<img src=x onerror="window.__xss=1"> <script>window.__xss=1</script> [bad](javascript:window.__xss=1)

- item <b>one</b>
- item two
"""


def canned_stream() -> str:
    def chunk(delta: dict, finish=None) -> str:
        return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"
    pieces = [CANNED[i:i + 7] for i in range(0, len(CANNED), 7)]
    timings = dict(cache_n=0, prompt_n=12, prompt_ms=10.0, prompt_per_token_ms=0.83, prompt_per_second=1200.0,
                   predicted_n=len(pieces), predicted_ms=100.0, predicted_per_token_ms=100 / len(pieces),
                   predicted_per_second=10 * len(pieces), draft_n=70, draft_n_accepted=35)
    spec = dict(block_size=8, verify_steps=10, draft_n=70, draft_n_accepted=35, mean_acceptance_length=4.5,
                acceptance_rate=0.5, acceptance_histogram=[0, 1, 1, 2, 2, 2, 1, 1, 0],
                per_position_acceptance=[0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1])
    final = {"object": "chat.completion.chunk", "choices": [], "timings": timings, "speculative": spec}
    return (chunk({"role": "assistant", "content": ""}) + chunk({"reasoning_content": "Think <i>first</i>"}) +
            "".join(chunk({"content": p}) for p in pieces) +
            chunk({}, "stop") + "data: " + json.dumps(final) + "\n\ndata: [DONE]\n\n")


PROPS = {"default_generation_settings": {"n_ctx": 4096, "params": {
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "n_predict": -1, "seed": -1}},
    "total_slots": 1, "model_path": "/models/target.gguf", "model_alias": "target", "draft_model_path": "/models/draft",
    "speculative": {"type": "dflash", "block_size": 8, "draft_window": None}, "reasoning": "auto",
    "chat_template": None, "build_info": "test"}


@pytest.fixture
def offline_page(browser):
    """The page's files and canned API answers served by the browser itself: no server. localhost keeps the
    page a secure context (clipboard). Chat request bodies are kept in page.requests."""
    requests = []

    def serve(route):
        path = route.request.url.split("//", 1)[1].split("/", 1)[1].split("?")[0]
        if path in ("", "index.html") or path.startswith("webui/"):
            f = WEBUI / (path.removeprefix("webui/") or "index.html")
            types = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
            route.fulfill(status=200, body=f.read_bytes(), headers={"Content-Type": types[f.suffix]})
        elif path == "props":
            route.fulfill(status=200, json=PROPS)
        elif path == "health":
            route.fulfill(status=200, json={"status": "ok"})
        elif path == "v1/chat/completions":
            requests.append(json.loads(route.request.post_data))
            route.fulfill(status=200, body=canned_stream(), headers={"Content-Type": "text/event-stream"})
        else:
            route.fulfill(status=404, json={"error": {"code": 404, "message": "File Not Found"}})

    def setup(ctx):
        ctx.route("http://localhost:9/**", serve)
        ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin="http://localhost:9")
    pg = open_page(browser, "http://localhost:9", setup)
    pg.requests = requests
    yield pg
    assert pg.errors == [], pg.errors
    pg.context.close()


def test_markdown_code_copy_and_no_html_injection(offline_page):
    """Model output is Markdown, highlighted and copyable, and never HTML; the server's statistics show under it."""
    page = offline_page
    page.click("#open-settings")
    page.fill("#set-system", "Be brief.")
    page.select_option("#set-reasoning", "off")
    page.click("#close-settings")
    send(page, "<b>not bold</b> <img src=x onerror=\"window.__xss=1\">")
    wait_answer(page, 1)
    answer = page.locator(".msg.assistant .content.answer")
    assert page.evaluate("window.__xss") is None
    assert answer.locator("img, script, b").count() == 0 and page.locator(".msg.user img").count() == 0
    assert page.inner_text(".msg.user .bubble") == "<b>not bold</b> <img src=x onerror=\"window.__xss=1\">"
    assert [a.get_attribute("href") for a in answer.locator("a").all()] == ["https://example.com/?a=1&b=2"]
    assert "[bad](javascript:window.__xss=1)" in answer.inner_text()
    assert "<img src=x" in answer.inner_text() and "item <b>one</b>" in answer.inner_text()
    assert answer.locator("strong").inner_text() == "bold" and answer.locator("li").count() == 2
    code = answer.locator(".codeblock")
    assert code.locator(".codelang").inner_text() == "python"
    assert code.locator(".tok-kw").all_inner_texts() == ["def", "return"]
    assert code.locator(".tok-fn").inner_text() == "add" and code.locator(".tok-com").inner_text() == '# "sum"'
    code.locator(".copy-btn").click()
    page.wait_for_function("document.querySelector('.codeblock .copy-btn').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == 'def add(a, b):\n    return a + b  # "sum"'
    stats = page.inner_text(".msg.assistant .stats")
    assert "accept len 4.50" in stats and "accepted 50.0%" in stats
    assert page.locator(".msg.assistant .stat-hist rect.bar").count() == 8
    thinking = page.locator(".msg.assistant details.thinking")
    thinking.locator("summary").click()  # reasoning is folded away under its summary
    assert thinking.locator(".content").inner_text() == "Think <i>first</i>"
    body, = page.requests
    assert body["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "<b>not bold</b> <img src=x onerror=\"window.__xss=1\">"}]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["stream"]
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert "max_tokens" not in body  # n_predict -1: until the model stops
