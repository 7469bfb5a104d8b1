"""The chat page (api/static/, api/ui.py) in a real browser: Debian's headless Chromium driven by
selenium through Debian's chromedriver (no browser download), against a real `cag serve` on
loopback with the tiny model, API keys on. One server and one browser for the module.

What the page sent is read from the browser's own network log (chromedriver's performance log),
what the server did from /metrics. Skipped, with the reason, where Chromium or chromedriver is
missing (.ci/run installs them).

`CAG_UI_SCREENSHOT=PATH` also writes the page's screenshot there (it is always written to a temp
path). The README's screenshot, docs/images/chat.png, comes from the real model on the handbook:
`python -m tests.test_ui docs/images/chat.png`.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import cag_command
from tests.conftest import REPO
from tests.test_api import KEY, served_notes

CHROMIUM = os.environ.get("CAG_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CAG_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
AUTH = {"Authorization": f"Bearer {KEY}"}
HOSTILE_NAME = "<img src=x onerror=alert(1)>.md"  # a document's file name
HOSTILE_TEXT = "Beware: <script>alert(1)</script> and <img src=x onerror=alert(1)> live here.\n"


def _missing() -> str | None:
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        return (f"no Chromium/chromedriver at {CHROMIUM} and {CHROMEDRIVER}: "
                "apt-get install chromium chromium-driver (.ci/run does)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


# -- the page without a browser --------------------------------------------------------------------
def test_page_files_and_headers(tiny_engine):
    """The page and its files, with a CSP that forbids inline script, and no inline script or handler
    in the page itself; /ui/<anything else> is 404 (nothing from the request reaches the file system)."""
    import re

    from tests.test_api import app_client

    with app_client(tiny_engine, api_keys=KEY) as c:
        r = c.get("/")  # open: a browser cannot send a key when it navigates
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
        assert directives["script-src"] == "'self'" and directives["connect-src"] == "'self'"
        assert directives["default-src"] == "'none'" and "unsafe" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        html = r.text
        assert all(re.search(r'\bsrc="ui/app\.js"', tag) for tag in re.findall(r"<script\b[^>]*>", html))
        assert not re.search(r"<script\b[^>]*>(?!</script>)", html), "no inline script"
        assert not re.search(r"\son[a-z]+\s*=", html, re.I), "no inline event handlers"
        assert not re.search(r"https?://", html), "no CDN or other origin"
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("icon.svg", "image/svg+xml")):
            r = c.get(f"/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
            assert r.headers["x-content-type-options"] == "nosniff" and "content-security-policy" in r.headers
        js = re.sub(r"(^|\s)//.*$", "", c.get("/ui/app.js").text, flags=re.M)  # the code, not its comments
        assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
        for storage in ("localStorage", "sessionStorage", "document.cookie", "indexedDB"):
            assert storage not in js, f"the key stays in memory: {storage} used"
        for bad in ("/ui/../app.py", "/ui/ui.py", "/ui/%2e%2e%2fui.py", "/ui/"):
            assert c.get(bad).status_code == 404, bad
        assert c.get("/docs").status_code == 401  # the API's docs, behind the key as before
        assert c.get("/docs", headers=AUTH).status_code == 200
        assert "/" not in c.get("/openapi.json", headers=AUTH).json()["paths"]  # the page is not an API route


def test_no_ui_turns_the_page_off(tiny_engine, monkeypatch):
    from cag.api.settings import load_api_settings
    from tests.test_api import app_client

    with app_client(tiny_engine, ui=False) as c:
        assert c.get("/").status_code == 404 and c.get("/ui/app.js").status_code == 404
        assert c.get("/docs").status_code == 200 and c.get("/v1/corpora").status_code == 200
    monkeypatch.setenv("CAG_UI", "false")
    assert load_api_settings().ui is False
    monkeypatch.delenv("CAG_UI")
    assert load_api_settings().ui is True and load_api_settings(ui=False).ui is False


def test_serve_no_ui_flag(monkeypatch):
    """`cag serve --no-ui` builds the app without the page (uvicorn is not started)."""
    import uvicorn
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from cag.cli.main import app

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda a, **kw: seen.setdefault("app", a))
    for args, status in ((["serve", "--no-ui"], 404), (["serve"], 200)):
        seen.clear()
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        assert seen["app"].state.service.settings.ui is (status == 200)
        c = TestClient(seen["app"], base_url="http://localhost")  # no lifespan: neither route needs the model
        assert c.get("/").status_code == status and c.get("/docs").status_code == 200


# -- a real server and a real browser ------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tiny_model_dir, models_dir, tmp_path_factory):
    """`cag serve` (keys on) over two corpora: `notes` and `xss`, whose documents hold HTML in their
    text and in a file name; `xss` is then made stale by editing that file, so its stale reasons
    name it."""
    root = tmp_path_factory.mktemp("ui")
    with served_notes(root, tiny_model_dir, models_dir, CAG_API_KEYS=KEY, CAG_WORKERS="2", CAG_MAX_TOKENS="24",
                      CAG_ANSWER_ROOM="2048") as (srv, env, home, _):
        xss = root / "xss"
        xss.mkdir()
        (xss / "notes.md").write_text(HOSTILE_TEXT)
        (xss / HOSTILE_NAME).write_text("The keeper said <b>hello</b> & left.\n")
        r = subprocess.run([*cag_command(), "ingest", str(xss), "--json"], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        (xss / HOSTILE_NAME).write_text("The keeper said <b>goodbye</b> & left.\n")
        srv.env = env
        yield srv


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if reason := _missing():
        pytest.skip(reason)
    driver = chromium(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield driver
    finally:
        driver.quit()


def chromium(profile: Path, size: str = "1100,900"):
    """Headless Debian Chromium through its chromedriver, as root may run it (no sandbox, nothing
    that phones home), a fresh profile; the network log on, and PROBE in every document."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", f"--window-size={size}", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    # before any page script, in every document: record alert/confirm/prompt and CSP violations
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": PROBE})
    return driver


PROBE = """
window.__probe = {alerts: [], violations: []};
for (const f of ["alert", "confirm", "prompt"]) {
  window[f] = (m) => { window.__probe.alerts.push(f + ":" + m); };
}
document.addEventListener("securitypolicyviolation",
  (e) => window.__probe.violations.push(e.violatedDirective + " " + e.blockedURI + " " + (e.sample || "")));
"""


class Page:
    """The page in the browser: small waits and reads, by element ids of api/static/index.html."""

    def __init__(self, driver, url: str):
        self.d, self.url = driver, url

    def js(self, script: str, *args):
        return self.d.execute_script(script, *args)

    def wait(self, what, timeout: float = 30.0, message: str = ""):
        from selenium.common.exceptions import TimeoutException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(self.d, timeout, poll_frequency=0.05).until(lambda _: what(), message)
        except TimeoutException:  # say what the page showed
            raise AssertionError(f"{message or 'timed out'}; the page showed:\n{self.js('return document.body.innerText')}"
                                 f"\nbrowser log: {self.d.get_log('browser')[-10:]}") from None

    def el(self, css: str):
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.CSS_SELECTOR, css)

    def visible(self, css: str) -> bool:
        return bool(self.js("const e = document.querySelector(arguments[0]); return !!e && !e.closest('[hidden]')", css))

    def open(self, key: str | None = KEY) -> None:
        self.d.get(self.url + "/")
        self.wait(lambda: self.visible("#key-form"), message="the page should ask for the key")
        self.d.get_log("performance")  # drop what the load logged
        if key:
            self.use_key(key)
            self.wait(lambda: self.js("return document.querySelectorAll('#corpus option').length") >= 2)

    def use_key(self, key: str) -> None:
        from selenium.webdriver.common.keys import Keys

        self.el("#key").send_keys(key, Keys.ENTER)

    def pick(self, corpus: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.el("#corpus")).select_by_value(corpus)

    def send(self, text: str) -> None:
        """Typed into the message box and sent with Enter, as a keyboard user does."""
        from selenium.webdriver.common.keys import Keys

        box = self.el("#input")
        box.send_keys(text, Keys.ENTER)

    def answers(self) -> list[dict]:
        return self.js("""return [...document.querySelectorAll('#log .turn.assistant')].map(li => ({
            text: li.querySelector('.text').textContent,
            pieces: li.querySelector('.text').childNodes.length,
            busy: li.getAttribute('aria-busy') === 'true',
            meta: [...li.querySelectorAll('.meta span')].map(s => s.className + '=' + s.textContent),
            stale: (li.querySelector('.stale-warning') || {}).textContent || null,
            stopped: !!li.querySelector('.stopped'),
            failed: li.classList.contains('failed'),
            copy: !!li.querySelector('button.copy')}))""")

    def answered(self, n: int, timeout: float = 60.0) -> dict:
        """Wait until the n-th answer is finished (its meta line or a failure shows); return it."""
        def done():
            got = self.answers()
            return len(got) >= n and not got[n - 1]["busy"] and (got[n - 1]["meta"] or got[n - 1]["failed"]) and got[n - 1]
        return self.wait(done, timeout, f"answer {n} should finish")

    def chat_requests(self) -> list[dict]:
        """Bodies of the POST /v1/chat/completions the page sent since the last call, from the
        browser's network log."""
        out = []
        for entry in self.d.get_log("performance"):
            msg = json.loads(entry["message"])["message"]
            if msg.get("method") != "Network.requestWillBeSent":
                continue
            req = msg["params"]["request"]
            if not req["url"].endswith("/v1/chat/completions") or req["method"] != "POST":
                continue
            if "postData" in req:
                data = req["postData"]
            else:
                data = b"".join(base64.b64decode(p["bytes"]) for p in req.get("postDataEntries", [])).decode()
            out.append({"body": json.loads(data), "auth": req["headers"].get("Authorization")})
        return out

    def probe(self) -> dict:
        return self.js("return window.__probe")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if line.split(" ")[0] == name:
                return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def page(site, browser):
    return Page(browser, site.url)


def test_a_wrong_key_is_refused_then_the_corpora_are_listed(page):
    page.open(key=None)
    assert "needs an API key" in page.el("#key-why").text
    page.use_key("not-the-key")
    page.wait(lambda: page.visible("#key-form") and "refused" in page.el("#key-why").text,
              message="a wrong key should be refused")
    assert "401" in page.el("#key-why").text and "missing or invalid API key" in page.el("#key-why").text
    assert page.js("return document.querySelectorAll('#corpus option').length") == 0
    page.use_key(KEY)
    page.wait(lambda: page.js("return document.querySelectorAll('#corpus option').length") == 2)
    assert not page.visible("#key-form")
    options = page.js("return [...document.querySelectorAll('#corpus option')].map(o => [o.value, o.textContent])")
    assert ["notes", "notes"] in options and ["xss", "xss (stale)"] in options
    page.pick("notes")
    assert page.visible("#corpus-info") and not page.visible("#corpus-stale")
    size = page.el("#corpus-size").text
    corpus = httpx.get(f"{page.url}/v1/corpora/notes", headers=AUTH).json()
    assert size.startswith(f"3 documents · {corpus['n_tokens']:,} tokens · ")
    assert page.el("#corpus-fresh").text.startswith("built ")
    # the key went nowhere but the Authorization header: not in the URL, not in storage
    assert page.js("return location.href") == page.url + "/"
    assert page.js("return localStorage.length + sessionStorage.length + document.cookie.length") == 0


def test_a_question_streams_the_answer_of_cag_ask(page, site):
    page.open()
    page.pick("notes")
    q = "When does the ferry leave?"
    page.send(q)
    a = page.answered(1)
    cli = subprocess.run([*cag_command(), "ask", "notes", q, "--json"], env=site.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)
    assert a["text"] == want["answer"] and a["text"]
    assert a["pieces"] > 1, "the answer arrives in pieces, each appended as it streams"
    meta = dict(m.split("=", 1) for m in a["meta"])
    assert meta["cached"] == f"cached {want['cached_tokens']} of {want['prompt_tokens']} prompt tokens"
    assert meta["ttft"].startswith("TTFT ") and meta["ttft"].endswith(" ms")
    assert a["copy"] and not a["stale"] and not a["stopped"]
    (sent,) = page.chat_requests()
    assert sent["auth"] == f"Bearer {KEY}"
    body = sent["body"]
    assert body["model"] == "notes" and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": q}]


def test_a_follow_up_sends_the_whole_conversation(page, site):
    """Shift+Enter is a new line, Enter sends; the follow-up carries the system message and every
    earlier turn, and the page shows the usage the server counted for that whole body."""
    from selenium.webdriver.common.keys import Keys

    page.open()
    page.pick("notes")
    page.el("details.options summary").click()
    page.el("#system").send_keys("Answer briefly.")
    page.send("Who keeps the lighthouse?")
    first = page.answered(1)
    box = page.el("#input")
    box.send_keys("And the ferry?", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "When does it return?")
    assert page.answers().__len__() == 1, "Shift+Enter must not send"
    box.send_keys(Keys.ENTER)
    second = page.answered(2)
    follow_up = "And the ferry?\nWhen does it return?"
    sent = [r["body"] for r in page.chat_requests()]
    assert len(sent) == 2
    system = {"role": "system", "content": "Answer briefly."}
    assert sent[0]["messages"] == [system, {"role": "user", "content": "Who keeps the lighthouse?"}]
    assert sent[1]["messages"] == [system, {"role": "user", "content": "Who keeps the lighthouse?"},
                                   {"role": "assistant", "content": first["text"]},
                                   {"role": "user", "content": follow_up}]
    # the same body, asked directly: the page shows what the server counted for the whole history
    # (issue 30: once earlier turns are part of the prompt, prompt_tokens grows with them)
    direct = httpx.post(f"{site.url}/v1/chat/completions", headers=AUTH, timeout=60,
                        json={**sent[1], "stream": False}).json()
    # (cached tokens may differ: the server kept the page's conversation and reuses it for this one)
    meta = dict(m.split("=", 1) for m in second["meta"])
    assert f" of {direct['usage']['prompt_tokens']} prompt tokens" in meta["cached"], meta
    prompt = lambda a: int(dict(m.split("=", 1) for m in a["meta"])["cached"].split()[3])  # noqa: E731
    assert prompt(second) > prompt(first) + 10, "the earlier turns are part of the prompt"
    assert second["text"] == direct["choices"][0]["message"]["content"]
    user_turns = page.js("return [...document.querySelectorAll('#log .turn.user .text')].map(e => e.textContent)")
    assert user_turns == ["Who keeps the lighthouse?", follow_up]

    # New chat starts over: nothing of the old conversation is sent again
    page.el("#new-chat").click()
    assert page.answers() == [] and page.js("return document.activeElement.id") == "input"
    page.send("Where is the bakery?")
    page.answered(1)
    (again,) = page.chat_requests()
    assert again["body"]["messages"] == [system, {"role": "user", "content": "Where is the bakery?"}]


def test_the_mode_picker_asks_cag_rag_and_the_answer_says_so(page, site):
    from selenium.webdriver.support.ui import Select

    page.open()
    page.pick("notes")
    page.el("details.options summary").click()
    Select(page.el("#mode")).select_by_value("cag+rag")
    q = "When does the ferry leave?"
    page.send(q)
    a = page.answered(1)
    meta = dict(m.split("=", 1) for m in a["meta"])
    assert meta["mode"] == "mode cag+rag" and meta["documents"].startswith("documents: ")
    (sent,) = page.chat_requests()
    assert sent["body"]["mode"] == "cag+rag"
    want = httpx.post(f"{site.url}/v1/ask", headers=AUTH, json={"corpus": "notes", "question": q, "mode": "cag+rag"}).json()
    assert a["text"] == want["answer"]


def test_stop_ends_the_stream_and_frees_the_slot(page, site):
    page.open()
    page.pick("notes")
    page.el("details.options summary").click()
    page.el("#max-tokens").send_keys("2000")
    before = metric(site.url, 'cag_generations_stopped_total{reason="disconnect"}')
    page.send("Tell me everything about the lighthouse, the ferry and the bakery.")
    page.wait(lambda: (page.answers() or [{}])[0].get("text"), message="the first tokens should arrive")
    assert page.answers()[0]["busy"] and page.el("#stop").is_enabled()
    page.el("#stop").click()
    a = page.wait(lambda: (lambda x: not x["busy"] and x)(page.answers()[0]), message="Stop should end the answer")
    assert a["stopped"] and not a["failed"] and a["text"]
    assert not page.el("#stop").is_enabled() and page.el("#send").is_enabled()
    # the server saw the client go and freed the generation's worker and its decode slot
    deadline = time.monotonic() + 30
    while metric(site.url, 'cag_generations_stopped_total{reason="disconnect"}') < before + 1:
        assert time.monotonic() < deadline, "the server should stop the generation when the page hangs up"
        time.sleep(0.1)
    while metric(site.url, "cag_generations_running") or metric(site.url, "cag_decode_batch"):
        assert time.monotonic() < deadline, "the worker and the decode slot should be free again"
        time.sleep(0.1)
    # the stopped answer stays in the conversation: the next turn sends what was shown
    page.el("#max-tokens").clear()
    page.send("Thanks.")
    page.answered(2)
    sent = [r["body"] for r in page.chat_requests()]
    assert sent[-1]["messages"][1] == {"role": "assistant", "content": a["text"]}
    assert "max_tokens" not in sent[-1] and sent[0]["max_tokens"] == 2000


def test_a_hostile_corpus_renders_as_text(page, site, tmp_path):
    """Document names (in the stale reasons), the question and the answer are text: no element is
    made from them, nothing runs, no CSP violation (which would mean something tried)."""
    page.open()
    page.pick("xss")
    assert page.visible("#corpus-stale")
    reasons = page.js("return [...document.querySelectorAll('#corpus-reasons li')].map(e => e.textContent)")
    assert f"documents changed: {HOSTILE_NAME}" in reasons
    question = "What does <img src=x onerror=alert(2)> say about <script>alert(3)</script>?"
    page.send(question)
    real = page.answered(1)
    assert real["stale"] and HOSTILE_NAME in real["stale"]  # the per-answer warning names it, as text
    direct = httpx.post(f"{site.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "xss", "messages": [{"role": "user", "content": question}], "temperature": 0}).json()
    assert real["text"] == direct["choices"][0]["message"]["content"]

    # the tiny model cannot be made to write HTML, so the answer's text is replaced in the browser:
    # the page's own fetch gets the real stream with its content pieces swapped for hostile ones
    # (a tag split across pieces too), and parses and renders it as it would any answer
    pieces = ["<img src=x ", "onerror=alert(4)>", " <script>alert(5)</script>", " <b>bold</b> &amp; done"]
    page.js(SWAP_PIECES, pieces)
    page.send("And then?")
    swapped = page.answered(2)
    assert swapped["text"] == "".join(pieces)

    tags = page.js("""return [...document.querySelectorAll('*')].map(e => e.tagName.toLowerCase())
                      .filter(t => ['img', 'script', 'b', 'iframe', 'object', 'embed', 'svg'].includes(t))""")
    assert tags == ["script"], tags  # the page's own ui/app.js only
    assert page.js("return document.scripts[0].getAttribute('src')") == "ui/app.js"
    assert page.js("return document.images.length") == 0
    shown = page.js("return document.body.innerText")
    assert HOSTILE_NAME in shown and question in shown and "".join(pieces) in shown
    probe = page.probe()
    assert probe == {"alerts": [], "violations": []}, probe
    # no script error and no CSP report in the console (the 401s of the key probe are network entries)
    severe = [e for e in page.d.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not severe, severe


SWAP_PIECES = """
const pieces = arguments[0];
const real = window.fetch;
window.fetch = async (url, init) => {
  const res = await real(url, init);
  if (!String(url).endsWith("chat/completions") || !res.ok) return res;
  const enc = new TextEncoder(), dec = new TextDecoder();
  let buf = "", swapped = false;
  const swap = new TransformStream({
    transform(chunk, out) {
      buf += dec.decode(chunk, {stream: true});
      let m;
      while ((m = /\\r?\\n\\r?\\n/.exec(buf))) {
        let ev = buf.slice(0, m.index + m[0].length);
        buf = buf.slice(m.index + m[0].length);
        if (ev.startsWith("data: {")) {
          const obj = JSON.parse(ev.slice(6).trim());
          const delta = obj.choices && obj.choices[0] && obj.choices[0].delta;
          if (delta && delta.content) {
            ev = swapped ? "" : pieces.map((p) => {
              const c = structuredClone(obj);
              c.choices[0].delta.content = p;
              return "data: " + JSON.stringify(c) + "\\n\\n";
            }).join("");
            swapped = true;
          }
        }
        if (ev) out.enqueue(enc.encode(ev));
      }
    },
  });
  window.fetch = real;
  return new Response(res.body.pipeThrough(swap), {status: res.status, headers: res.headers});
};
"""


def test_copy_keyboard_and_a_phone_screen(page, site, tmp_path):
    """Copy puts the answer on the clipboard; the controls are reachable with Tab; at 375 px wide
    nothing scrolls sideways and the composer is on screen; a screenshot is written."""
    from selenium.webdriver.common.keys import Keys

    page.d.execute_cdp_cmd("Browser.grantPermissions", {"origin": site.url,
                                                        "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    page.open()
    page.pick("notes")
    page.send("What does the bakery sell on Tuesdays?")
    a = page.answered(1)
    page.el("#log button.copy").click()
    page.wait(lambda: page.el("#log button.copy").text == "Copied")
    clip = page.d.execute_async_script("navigator.clipboard.readText().then(arguments[0], e => arguments[0]('ERR ' + e))")
    assert clip == a["text"]

    # keyboard: from the corpus picker, Tab reaches each control in order, each one visibly focused
    page.el("#corpus").click()
    page.el("#corpus").send_keys(Keys.ESCAPE)
    order = []
    for _ in range(8):
        page.d.switch_to.active_element.send_keys(Keys.TAB)
        order.append(page.js("const e = document.activeElement; return e.id || e.className || e.tagName"))
    for want in ("reload", "new-chat", "copy", "input", "send"):
        assert want in order, order
    assert page.js("return getComputedStyle(document.activeElement, ':focus-visible').outlineStyle") != "none"

    shot = tmp_path / "chat.png"
    page.d.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if out := os.environ.get("CAG_UI_SCREENSHOT"):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)

    page.d.set_window_size(375, 740)
    try:
        page.wait(lambda: page.js("return window.innerWidth") <= 400)
        assert page.js("return document.documentElement.scrollWidth <= window.innerWidth"), "no sideways scroll"
        rect = page.js("return document.getElementById('send').getBoundingClientRect().toJSON()")
        assert 0 <= rect["left"] and rect["right"] <= page.js("return window.innerWidth")
        page.d.save_screenshot(str(tmp_path / "chat-narrow.png"))
    finally:
        page.d.set_window_size(1100, 900)


# -- the README's screenshot, from the real model ----------------------------------------------
def readme_screenshot(out: Path, narrow: Path | None = None) -> None:
    """`python -m tests.test_ui docs/images/chat.png`: the embedded model on the handbook (ingested
    into CAG_HOME, a temp one unless set; the model materialized under CAG_MODELS_DIR or that home),
    two turns in the page at 1100x860 (and at a phone's 390 px into `narrow`, when given)."""
    import tempfile

    from bench.harness import serving
    from tests.conftest import HANDBOOK

    if reason := _missing():
        sys.exit(reason)
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAG_") or k in ("CAG_MODELS_DIR", "CAG_HOME")}
        env.setdefault("CAG_HOME", f"{tmp}/home")
        env.update(CAG_API_KEYS="screenshot-key", CAG_MAX_TOKENS="64")
        r = subprocess.run([*cag_command(), "ingest", str(HANDBOOK)], env=env, cwd=REPO)
        assert r.returncode == 0
        with serving(env, Path(tmp) / "server.log", cwd=REPO, timeout_s=300) as srv:
            driver = chromium(Path(tmp) / "profile", "1100,860")
            try:
                p = Page(driver, srv.url)
                p.open(key=None)
                p.use_key("screenshot-key")
                p.wait(lambda: p.js("return document.querySelectorAll('#corpus option').length") >= 1)
                p.pick("handbook")
                p.send("What is the name of the paging tool?")
                p.answered(1, timeout=600)
                p.send("Who is on call for it?")
                p.answered(2, timeout=600)
                p.js("document.activeElement.blur()")
                out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(out))
                if narrow:
                    driver.set_window_size(390, 844)
                    driver.save_screenshot(str(narrow))
            finally:
                driver.quit()
    print(out)


if __name__ == "__main__":
    readme_screenshot(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images/chat.png"),
                      Path(sys.argv[2]) if len(sys.argv) > 2 else None)
