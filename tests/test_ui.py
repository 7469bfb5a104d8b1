"""The chat page (api/static/, api/ui.py) in a real browser: Debian's headless Chromium driven by
selenium through Debian's chromedriver (no browser download), against a real `cag serve` on
loopback with the tiny model, API keys on. One server and one browser for the module.

What the page sent is read from the browser's own network log (chromedriver's performance log), what the server did from
/metrics, what it keeps (conversations, settings) from its localStorage; a broken stream and hostile answers are made by
wrapping the page's own fetch in the browser. Skipped, with the reason, where Chromium or chromedriver is missing
(.ci/run installs them).

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
        scripts = [re.search(r'\bsrc="([^"]+)"', tag) for tag in re.findall(r"<script\b[^>]*>", html)]
        assert [m and m[1] for m in scripts] == ["ui/vendor/marked.umd.js", "ui/vendor/purify.min.js", "ui/app.js"]
        assert not re.search(r"<script\b[^>]*>(?!</script>)", html), "no inline script"
        assert not re.search(r"\son[a-z]+\s*=", html, re.I), "no inline event handlers"
        assert not re.search(r"https?://", html), "no CDN or other origin"
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css"), ("icon.svg", "image/svg+xml"),
                           ("vendor/marked.umd.js", "text/javascript"), ("vendor/purify.min.js", "text/javascript")):
            r = c.get(f"/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
            assert r.headers["x-content-type-options"] == "nosniff" and "content-security-policy" in r.headers
        js = re.sub(r"(^|\s)//.*$", "", c.get("/ui/app.js").text, flags=re.M)  # the code, not its comments
        # the page's own script makes no HTML from strings: text as text, markdown as DOMPurify's nodes
        assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
        assert "eval(" not in js and "document.write" not in js and "RETURN_DOM_FRAGMENT: true" in js
        for storage in ("sessionStorage", "document.cookie", "indexedDB"):  # conversations: localStorage only
            assert storage not in js, storage
        # the vendored builds run under script-src 'self': no eval, no Function constructor
        for name in ("vendor/marked.umd.js", "vendor/purify.min.js"):
            lib = c.get(f"/ui/{name}").text
            assert not re.search(r"\beval\s*\(|\bnew\s+Function\b|\bFunction\s*\(", lib), name
        for bad in ("/ui/../app.py", "/ui/ui.py", "/ui/%2e%2e%2fui.py", "/ui/", "/ui/vendor/", "/ui/vendor/README.md",
                    "/ui/vendor/../ui.py", "/ui/vendor%2f..%2fui.py", "/ui/vendor/marked.LICENSE"):
            assert c.get(bad).status_code == 404, bad
        assert c.get("/docs").status_code == 401  # the API's docs, behind the key as before
        assert c.get("/docs", headers=AUTH).status_code == 200
        assert "/" not in c.get("/openapi.json", headers=AUTH).json()["paths"]  # the page is not an API route


def test_the_vendored_libraries_ship_with_their_licenses():
    """marked and DOMPurify are copied unchanged (the hashes in vendor/README.md) with their license
    files, and the wheel's package data names them."""
    import fnmatch
    import hashlib

    import tomllib

    vendor = REPO / "api" / "static" / "vendor"
    readme = (vendor / "README.md").read_text()
    for name in ("marked.umd.js", "purify.min.js"):
        digest = hashlib.sha256((vendor / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in readme, name
    for lic in ("marked.LICENSE", "dompurify.LICENSE", "dompurify.LICENSE-MPL"):
        assert (vendor / lic).stat().st_size > 1000, lic
    assert "marked v18.3.0" in (vendor / "marked.umd.js").read_text()[:200]
    assert "DOMPurify 3.5.0" in (vendor / "purify.min.js").read_text()[:200]
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["cag.api"]
    for f in vendor.iterdir():
        rel = f"static/vendor/{f.name}"
        assert any(fnmatch.fnmatch(rel, pat) for pat in data), f"{rel} is not in the wheel's package data"


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
        srv.env, srv.xss = env, xss
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
            raise AssertionError(
                f"{message or 'timed out'}; the page showed:\n{self.js('return document.body.innerText')}\nbrowser "
                f"log: {self.d.get_log('browser')[-10:]}"
            ) from None

    def el(self, css: str):
        from selenium.webdriver.common.by import By

        return self.d.find_element(By.CSS_SELECTOR, css)

    def visible(self, css: str) -> bool:
        return bool(
            self.js("const e = document.querySelector(arguments[0]); return !!e && !e.closest('[hidden]')", css)
        )

    def open(self, key: str | None = KEY, clear: bool = True) -> None:
        """Load the page (by default with nothing kept in the browser: no conversations, no
        settings) and give it the key."""
        if clear:
            self.d.get(self.url + "/")
            self.js("localStorage.clear()")
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
        """The answers shown: `text` as shown (rendered markdown), `raw` the answer's own text as the
        page keeps it in the browser's storage (None while it streams)."""
        return self.js("""
            const active = JSON.parse(localStorage.getItem('cag.active.v1') || 'null');
            const conv = JSON.parse(localStorage.getItem('cag.chats.v1') || '[]').find(c => c.id === active);
            const raw = conv ? conv.messages.filter(m => m.role === 'assistant').map(m => m.content) : [];
            return [...document.querySelectorAll('#log .turn.assistant')].map((li, i) => ({
            text: li.querySelector('.text').textContent,
            raw: li.getAttribute('aria-busy') === 'true' ? null : (raw[i] ?? null),
            busy: li.getAttribute('aria-busy') === 'true',
            meta: [...li.querySelectorAll('.meta span')].map(s => s.className + '=' + s.textContent),
            stale: (li.querySelector('.stale-warning') || {}).textContent || null,
            sources: [...li.querySelectorAll('.sources li')].map(e => e.textContent),
            error: (li.querySelector('.error') || {}).textContent || null,
            stopped: !!li.querySelector('.stopped'),
            failed: li.classList.contains('failed'),
            regenerate: (li.querySelector('button.regenerate') || {}).textContent || null,
            copy: !!li.querySelector('button.copy')}))""")

    def questions(self) -> list[str]:
        return self.js("return [...document.querySelectorAll('#log .turn.user .text')].map(e => e.textContent)")

    def titles(self) -> list[str]:
        """The sidebar's conversations, most recent first."""
        return self.js("return [...document.querySelectorAll('#chat-list .chat-title')].map(e => e.textContent)")

    def in_sidebar(self, title: str, css: str):
        """A control (`.chat-open`, `.chat-rename`, `.chat-delete`) of the conversation titled `title`."""
        return self.js("""const li = [...document.querySelectorAll('#chat-list .chat-item')]
                            .find(li => (li.querySelector('.chat-title') || {}).textContent === arguments[0]);
                          return li ? li.querySelector(arguments[1]) : null""", title, css)

    def stored(self) -> str:
        """Everything the page keeps in the browser, as one string."""
        return self.js(
            "return JSON.stringify({...localStorage}) + JSON.stringify({...sessionStorage}) + document.cookie"
        )

    def count_renders(self) -> None:
        """From now on, window.__renders counts the times an answer's text is (re)rendered in place."""
        self.js("""window.__renders = 0;
            new MutationObserver((recs) => { for (const r of recs) {
              if (r.target.matches && r.target.matches('.turn.assistant .text')) window.__renders++; } })
            .observe(document.getElementById('log'), {childList: true, subtree: true});""")

    def answered(self, n: int, timeout: float = 60.0) -> dict:
        """Wait until the n-th answer is finished (its meta line or a failure shows); return it."""
        def done():
            got = self.answers()
            return (
                len(got) >= n and not got[n - 1]["busy"] and (got[n - 1]["meta"] or got[n - 1]["failed"]) and got[n - 1]
            )

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
    page.count_renders()
    q = "When does the ferry leave?"
    page.send(q)
    a = page.answered(1)
    cli = subprocess.run([*cag_command(), "ask", "notes", q, "--json"], env=site.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)
    assert a["raw"] == want["answer"] and a["text"]
    assert page.js("return window.__renders") > 1, "the answer is shown as it streams, piece by piece"
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
    assert "top_p" not in body and "max_tokens" not in body and "mode" not in body
    assert KEY not in page.stored() and page.js("return sessionStorage.length + document.cookie.length") == 0


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
                                   {"role": "assistant", "content": first["raw"]},
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
    assert second["raw"] == direct["choices"][0]["message"]["content"]
    assert page.questions() == ["Who keeps the lighthouse?", follow_up]

    # New chat starts over: nothing of the old conversation is sent again
    page.el("#new-chat").click()
    assert page.answers() == [] and page.js("return document.activeElement.id") == "input"
    page.send("Where is the bakery?")
    page.answered(1)
    (again,) = page.chat_requests()
    assert again["body"]["messages"] == [system, {"role": "user", "content": "Where is the bakery?"}]
    assert page.titles() == ["Where is the bakery?", "Who keeps the lighthouse?"]


def test_settings_are_sent_and_kept(page):
    """Temperature, top-p, the length limit and the system message go as OpenAI's fields; they are
    kept in the browser across a reload; a value the server would refuse is not sent."""
    page.open()
    page.pick("notes")
    page.el("details.options summary").click()
    for css, value in (("#temperature", "0.7"), ("#top-p", "0.9"), ("#max-tokens", "5"), ("#system", "Be terse.")):
        page.el(css).clear()
        page.el(css).send_keys(value)
    page.send("Who keeps the lighthouse?")
    a = page.answered(1)
    (sent,) = page.chat_requests()
    body = sent["body"]
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["max_tokens"] == 5
    assert body["messages"][0] == {"role": "system", "content": "Be terse."}
    assert int(dict(m.split("=", 1) for m in a["meta"])["completion"].split()[0]) <= 5

    page.open(clear=False)  # a reload: the settings are still there (the key is asked again)
    page.el("details.options summary").click()
    assert [page.el(c).get_attribute("value") for c in ("#temperature", "#top-p", "#max-tokens", "#system")] == \
        ["0.7", "0.9", "5", "Be terse."]
    assert KEY not in page.stored()
    page.el("#temperature").clear()
    page.el("#temperature").send_keys("3")
    page.send("And the ferry?")
    page.wait(lambda: "Temperature is a number from 0 to 2" in page.el("#notice").text)
    assert page.chat_requests() == [] and page.el("#input").get_attribute("value") == "And the ferry?"


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
    assert meta["mode"] == "mode cag+rag"
    (sent,) = page.chat_requests()
    assert sent["body"]["mode"] == "cag+rag"
    want = httpx.post(
        f"{site.url}/v1/ask", headers=AUTH, json={"corpus": "notes", "question": q, "mode": "cag+rag"}
    ).json()
    assert a["raw"] == want["answer"]
    # the sources: the passages the answer read besides the snapshot, as the server named them
    assert a["sources"] == [p["name"] for p in want["passages"] if p.get("quoted", True)] and a["sources"]


LONG_ANSWERS = 1000  # tokens a probe asks for: Stop must land while the page's answer is still running


def long_question(url: str) -> str:
    """A question the model answers for at least LONG_ANSWERS tokens on this CPU. The random model
    ends some answers after ~200 tokens, which a busy CI machine decoded before Stop was clicked; a
    probe through the API with the body the page sends picks a long one. Greedy decoding is exact,
    so the page's answer starts with the probe's tokens and runs at least as long."""
    for q in ("What happens in the notes, step by step?", "Describe the harbour town in detail.",
              "List every place and person the notes mention.", "Write a long story about the ferry.",
              "Tell me everything about the lighthouse, the ferry and the bakery."):
        body = {"model": "notes", "messages": [{"role": "user", "content": q}], "temperature": 0,
                "max_tokens": LONG_ANSWERS}
        r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=120)
        assert r.status_code == 200, r.text
        if r.json()["choices"][0]["finish_reason"] == "length":
            return q
    pytest.fail(f"no probe question ran to {LONG_ANSWERS} tokens: Stop cannot be tested mid-answer")


def test_stop_ends_the_stream_and_frees_the_slot(page, site):
    q = long_question(site.url)
    page.open()
    page.pick("notes")
    page.el("details.options summary").click()
    page.el("#max-tokens").send_keys("2000")
    before = metric(site.url, 'cag_generations_stopped_total{reason="disconnect"}')
    page.send(q)
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
    assert sent[-1]["messages"][1] == {"role": "assistant", "content": a["raw"]}
    assert "max_tokens" not in sent[-1] and sent[0]["max_tokens"] == 2000


# an answer as a model quoting a hostile document might write it, with markdown around it; split
# across stream pieces (a tag cut in two too)
HOSTILE_ANSWER = ["<img src=x ", "onerror=alert(4)>", " <script>alert(5)</script>", " <b>bold</b> &amp; done\n\n",
                  "**stro", "ng** and `co", "de`\n\n- one\n- two\n\n", "[a link](javascript:alert(6)) ",
                  "![a picture](x.png) ", '<a href="javascript:alert(7)">raw link</a> ',
                  "<svg onload=alert(8)></svg>"]


def test_a_hostile_corpus_renders_as_text(page, site):
    """Document and file names (stale reasons, sources), questions, conversation titles and answers
    cannot make the page run anything. Names and questions are text; an answer is markdown whose raw
    HTML is shown as the text it is and whose HTML passes DOMPurify's allow-list: nothing runs, no
    element carries a handler, no image loads, no CSP violation (which would mean something tried);
    the same after a reload, when it all comes back from the browser's storage."""
    from selenium.webdriver.support.ui import Select

    page.open()
    page.pick("xss")
    assert page.visible("#corpus-stale")
    reasons = page.js("return [...document.querySelectorAll('#corpus-reasons li')].map(e => e.textContent)")
    assert f"documents changed: {HOSTILE_NAME}" in reasons
    page.el("details.options summary").click()
    Select(page.el("#mode")).select_by_value("rag")  # the sources are then passages of the hostile file
    question = "What does <img src=x onerror=alert(2)> say about <script>alert(3)</script>?"
    page.send(question)
    real = page.answered(1)
    assert real["stale"] and HOSTILE_NAME in real["stale"]  # the per-answer warning names it, as text
    direct = httpx.post(f"{site.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "xss", "messages": [{"role": "user", "content": question}], "temperature": 0, "mode": "rag"}).json()
    assert real["raw"] == direct["choices"][0]["message"]["content"]
    assert real["sources"] == direct["cag"]["passages"]
    assert any(s.startswith("<img src=x onerror=alert(1)>#") for s in real["sources"]), real["sources"]

    # the tiny model cannot be made to write HTML, so the answer's text is replaced in the browser:
    # the page's own fetch gets the real stream with its content pieces swapped for hostile ones,
    # and parses and renders it as it would any answer
    page.js(SWAP_PIECES, HOSTILE_ANSWER)
    page.send("And then?")
    swapped = page.answered(2)
    assert swapped["raw"] == "".join(HOSTILE_ANSWER)

    def inert():
        tags = page.js("""return [...document.querySelectorAll('*')].map(e => e.tagName.toLowerCase()).filter(t =>
            ['img', 'script', 'b', 'iframe', 'object', 'embed', 'svg', 'style', 'link', 'meta', 'base'].includes(t))""")
        assert tags == ["meta", "meta", "link", "link", "script", "script", "script"], tags  # the page's own only
        made = page.js("""return [...document.querySelectorAll('#log *, #chat-list *, #corpus-info *')]
            .map(e => e.tagName.toLowerCase()).filter(t => ['input', 'form', 'textarea', 'select'].includes(t))""")
        assert made == [], made  # no form controls made from an answer, a title or a name
        assert page.js("return [...document.scripts].map(s => s.getAttribute('src'))") == [
            "ui/vendor/marked.umd.js", "ui/vendor/purify.min.js", "ui/app.js"]
        assert page.js("return document.images.length") == 0
        handlers = page.js("""return [...document.querySelectorAll('*')]
            .flatMap(e => [...e.attributes].map(a => a.name)).filter(n => n.startsWith('on'))""")
        assert handlers == [], handlers
        md = page.js("""const t = [...document.querySelectorAll('#log .turn.assistant .text')].at(-1);
            const all = (css) => [...t.querySelectorAll(css)].map(e => e.textContent);
            return {strong: all('strong'), code: all('code'), li: all('li'),
                    a: [...t.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href')])}""")
        assert md == {"strong": ["strong"], "code": ["code"], "li": ["one", "two"], "a": [["a link", None]]}, md
        shown = page.js("return document.body.innerText")
        for text in (HOSTILE_NAME, question, "<img src=x onerror=alert(4)>", "<script>alert(5)</script>",
                     "<b>bold</b> & done", '<a href="javascript:alert(7)">raw link</a>', "<svg onload=alert(8)></svg>"):
            assert text in shown, text
        assert page.titles()[0] == question  # the conversation's title, from the question: text
        probe = page.probe()
        assert probe == {"alerts": [], "violations": []}, probe
        # no script error and no CSP report in the console (the 401s of the key probe are network entries)
        severe = [e for e in page.d.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert not severe, severe

    inert()
    page.open(clear=False)  # a reload: the conversation, from the browser's storage, shown again
    page.wait(lambda: len(page.answers()) == 2 and page.visible("#corpus-stale"))
    assert page.el("#corpus").get_attribute("value") == "xss" and page.answers()[1]["raw"] == swapped["raw"]
    inert()


def test_regenerate_edit_and_conversations_kept_across_reloads(page):
    """Regenerate asks the last question again; Edit changes a question and drops the turns after
    it; the conversations are in the sidebar after a reload, can be switched, renamed and deleted."""
    from selenium.webdriver.common.keys import Keys

    page.open()
    page.pick("notes")
    u1, u2 = "Who keeps the lighthouse?", "When does the ferry leave?"
    page.send(u1)
    a1 = page.answered(1)
    page.send(u2)
    a2 = page.answered(2)
    assert [a["regenerate"] for a in page.answers()] == [None, "Regenerate"], "only the last answer"
    page.chat_requests()

    page.el("#log .turn.assistant:last-child button.regenerate").click()
    again = page.answered(2)
    (sent,) = page.chat_requests()
    assert sent["body"]["messages"] == [{"role": "user", "content": u1}, {"role": "assistant", "content": a1["raw"]},
                                        {"role": "user", "content": u2}]
    assert len(page.answers()) == 2 and again["raw"] == a2["raw"]  # greedy: the same answer again

    page.el("#log .turn.user button.edit").click()  # the first question
    box = page.el("#log .edit-box")
    assert box.get_attribute("value") == u1
    box.clear()
    box.send_keys("Where is the bakery?", Keys.ENTER)
    page.wait(lambda: len(page.answers()) == 1, message="the turns after the edited question go")
    edited = page.answered(1)
    (sent,) = page.chat_requests()
    assert sent["body"]["messages"] == [{"role": "user", "content": "Where is the bakery?"}]
    assert page.questions() == ["Where is the bakery?"]
    assert page.titles() == ["Where is the bakery?"]

    page.open(clear=False)  # a reload: the conversation is back (the key is not: it is asked again)
    page.wait(lambda: page.answers() and page.answers()[0]["meta"])
    assert page.questions() == ["Where is the bakery?"] and page.answers()[0]["raw"] == edited["raw"]
    assert page.answers()[0]["meta"] == edited["meta"] and page.titles() == ["Where is the bakery?"]
    assert KEY not in page.stored()

    page.el("#new-chat").click()
    page.send(u1)
    page.answered(1)
    assert page.titles() == [u1, "Where is the bakery?"]
    page.in_sidebar("Where is the bakery?", ".chat-open").click()
    assert page.questions() == ["Where is the bakery?"] and page.answers()[0]["raw"] == edited["raw"]
    page.in_sidebar(u1, ".chat-open").click()
    assert page.questions() == [u1]

    page.in_sidebar("Where is the bakery?", ".chat-rename").click()
    box = page.el("#chat-list .chat-rename-box")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("Bakery <b>hours</b>", Keys.ENTER)
    page.wait(lambda: "Bakery <b>hours</b>" in page.titles())
    page.open(clear=False)
    page.wait(lambda: page.titles() == [u1, "Bakery <b>hours</b>"])
    assert page.questions() == [u1], "the conversation shown last is shown again"

    page.in_sidebar("Bakery <b>hours</b>", ".chat-open").click()
    delete = page.in_sidebar("Bakery <b>hours</b>", ".chat-delete")
    delete.click()
    assert page.titles() == [u1, "Bakery <b>hours</b>"] and delete.text == "Delete?", "a second click deletes"
    delete.click()
    assert page.titles() == [u1] and page.questions() == [] and page.answers() == []
    page.open(clear=False)
    page.wait(lambda: page.titles() == [u1])


BREAK_STREAM = """
const keep = arguments[0];
const real = window.fetch;
window.fetch = async (url, init) => {
  const res = await real(url, init);
  if (!String(url).endsWith("chat/completions") || !res.ok) return res;
  window.fetch = real;
  const dec = new TextDecoder();
  let buf = "", seen = 0;
  const cut = new TransformStream({
    transform(chunk, out) {
      buf += dec.decode(chunk, {stream: true});
      let m;
      while ((m = /\\r?\\n\\r?\\n/.exec(buf))) {
        const ev = buf.slice(0, m.index + m[0].length);
        buf = buf.slice(m.index + m[0].length);
        if (/"content":\\s*"[^"]/.test(ev) && ++seen > keep) {
          // the connection drops here, once the page has read what came before (an error
          // discards what is still queued)
          return new Promise((done) => setTimeout(() => { out.error(new TypeError("network error")); done(); }, 300));
        }
        out.enqueue(new TextEncoder().encode(ev));
      }
    },
  });
  return new Response(res.body.pipeThrough(cut), {status: res.status, headers: res.headers});
};
"""


def test_a_broken_stream_keeps_the_partial_answer(page, site):
    """The connection drops mid-answer: what arrived stays shown, the error under it, Retry asks
    again; after a reload both are still there."""
    page.open()
    page.pick("notes")
    q = "What does the bakery sell on Tuesdays?"
    page.js(BREAK_STREAM, 3)
    page.send(q)
    a = page.answered(1)
    assert a["failed"] and a["error"] == "The answer broke off: network error", a
    full = httpx.post(f"{site.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "notes", "messages": [{"role": "user", "content": q}], "temperature": 0}).json()
    full = full["choices"][0]["message"]["content"]
    assert a["raw"] and full.startswith(a["raw"]) and len(a["raw"]) < len(full), (a["raw"], full)
    assert a["text"].strip() and a["regenerate"] == "Retry" and a["copy"]
    assert "answer so far is kept" in page.el("#status").text

    page.open(clear=False)
    page.wait(lambda: page.answers() and page.answers()[0]["failed"])
    kept = page.answers()[0]
    assert kept["raw"] == a["raw"] and kept["error"] == a["error"]
    page.chat_requests()
    page.el("#log button.regenerate").click()
    retried = page.answered(1)
    assert retried["raw"] == full and not retried["failed"] and retried["error"] is None
    (sent,) = page.chat_requests()
    assert sent["body"]["messages"] == [{"role": "user", "content": q}]


def test_dark_mode_follows_the_system(page):
    """prefers-color-scheme picks the colours (CSS only), emulated through CDP."""
    page.open()
    page.pick("notes")
    colours = ("return [getComputedStyle(document.body).backgroundColor, getComputedStyle(document.body).color,"
               " getComputedStyle(document.getElementById('sidebar')).backgroundColor]")
    try:
        seen = {}
        for scheme in ("dark", "light"):
            page.d.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                   {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
            assert page.js("return matchMedia('(prefers-color-scheme: dark)').matches") is (scheme == "dark")
            seen[scheme] = page.js(colours)
        assert seen["dark"] == ["rgb(23, 24, 27)", "rgb(236, 236, 239)", "rgb(23, 24, 27)"], seen
        assert seen["light"] == ["rgb(247, 247, 245)", "rgb(29, 29, 31)", "rgb(247, 247, 245)"], seen
    finally:
        page.d.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})


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

    page.d.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": site.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    page.open()
    page.pick("notes")
    page.send("What does the bakery sell on Tuesdays?")
    a = page.answered(1)
    page.el("#log button.copy").click()
    page.wait(lambda: page.el("#log button.copy").text == "Copied")
    clip = page.d.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], e => arguments[0]('ERR ' + e))"
    )
    assert clip == a["raw"]  # the answer's markdown

    # keyboard: from the corpus picker, Tab reaches each control in order, each one visibly focused
    page.el("#corpus").click()
    page.el("#corpus").send_keys(Keys.ESCAPE)
    order = []
    for _ in range(10):
        page.d.switch_to.active_element.send_keys(Keys.TAB)
        order.append(page.js("const e = document.activeElement; return e.id || e.className || e.tagName"))
    wants = ["reload", "refresh-corpus", "edit", "copy", "regenerate", "SUMMARY", "input", "send"]
    assert [o for o in order if o in wants] == wants, order
    page.js("document.getElementById('new-chat').focus()")  # the sidebar: New chat, then each conversation
    page.d.switch_to.active_element.send_keys(Keys.TAB)
    assert page.js("return document.activeElement.className") == "chat-open"
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
        # the conversations are a panel behind the "Chats" button
        shown = "return getComputedStyle(document.getElementById('sidebar')).display !== 'none'"
        assert not page.js(shown)
        page.el("#toggle-chats").click()
        assert page.js(shown) and page.el("#chat-list .chat-open").is_displayed()
        assert page.el("#toggle-chats").get_attribute("aria-expanded") == "true"
        assert page.js("return document.documentElement.scrollWidth <= window.innerWidth")
        page.d.save_screenshot(str(tmp_path / "chat-narrow.png"))
        page.el("#close-chats").click()
        assert not page.js(shown) and page.js("return document.activeElement.id") == "toggle-chats"
    finally:
        page.d.set_window_size(1100, 900)


REFUSE_REFRESH = """
const real = window.fetch;
window.fetch = async (url, init) => {
  if (!String(url).endsWith("/refresh")) return real(url, init);
  window.fetch = real;
  return new Response(JSON.stringify({error: {message: "cross-site request refused", code: "cross_site"}}),
                      {status: 403, headers: {"Content-Type": "application/json"}});
};
"""


def test_refresh_corpus_and_a_stale_badge_that_follows_the_server(page, site):
    """Refresh corpus starts the server's refresh job and shows its progress until done; a refusal
    (403) is said; the stale badge follows the corpus on disk without Reload list (the page reads
    the list again when it gets the focus, and every 30 s). Last: it changes the `xss` corpus."""
    page.open()
    page.pick("xss")
    assert page.visible("#corpus-stale") and page.el("#refresh-corpus").is_enabled()
    page.js(REFUSE_REFRESH)
    page.el("#refresh-corpus").click()
    page.wait(lambda: "Refresh not allowed with this API key (403): cross-site request refused"
              in page.el("#refresh-state").text)
    assert page.visible("#corpus-stale") and page.el("#refresh-corpus").is_enabled()

    page.js("""window.__job = []; new MutationObserver(() => window.__job.push(
                 document.getElementById('refresh-state').textContent))
               .observe(document.getElementById('refresh-state'), {childList: true, characterData: true, subtree: true})""")  # noqa: E501
    page.d.get_log("performance")
    page.el("#refresh-corpus").click()
    page.wait(lambda: page.el("#refresh-state").text.startswith("Refreshed xss"), 120, "the refresh should finish")
    page.wait(lambda: not page.visible("#corpus-stale"))
    shown = page.js("return window.__job")
    assert any(t.startswith("Refreshing xss") for t in shown), shown
    polled = [json.loads(e["message"])["message"]["params"]["request"]["url"] for e in page.d.get_log("performance")
              if json.loads(e["message"])["message"].get("method") == "Network.requestWillBeSent"]
    assert any("/v1/corpora/xss/refresh" in u for u in polled) and any("/v1/jobs/job_" in u for u in polled), polled
    assert httpx.get(f"{site.url}/v1/corpora/xss", headers=AUTH).json()["stale"] is False
    assert ["xss", "xss"] in page.js(
        "return [...document.querySelectorAll('#corpus option')].map(o => [o.value, o.textContent])"
    )

    (site.xss / "notes.md").write_text(HOSTILE_TEXT + "A line added.\n")
    page.js("window.dispatchEvent(new Event('focus'))")
    page.wait(lambda: page.visible("#corpus-stale"), message="the badge should come back on its own")
    reasons = page.js("return [...document.querySelectorAll('#corpus-reasons li')].map(e => e.textContent)")
    assert any("notes.md" in r for r in reasons), reasons
    assert "xss (stale)" in page.js("return [...document.querySelectorAll('#corpus option')].map(o => o.textContent)")
    assert page.probe() == {"alerts": [], "violations": []}


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
