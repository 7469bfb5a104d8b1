// cag chat page: pick a corpus, chat with it over POST /v1/chat/completions (streamed).
// Plain script, no build step. Answers are markdown: marked turns them into HTML, in which raw
// HTML is escaped (shown as text), and DOMPurify keeps only an allow-list of tags and attributes
// before the result is put in the page as nodes (ui/vendor/, loaded before this file). Everything
// else from the server or the browser's storage (corpus, document and file names, reasons, errors,
// questions, conversation titles) is put in the page with textContent, never as HTML.
//
// Conversations and settings are kept in this browser's localStorage; the API key never is.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    corpus: $("corpus"), reload: $("reload"), refresh: $("refresh-corpus"), newChat: $("new-chat"),
    sidebar: $("sidebar"), chatList: $("chat-list"), toggleChats: $("toggle-chats"),
    info: $("corpus-info"), size: $("corpus-size"), fresh: $("corpus-fresh"),
    stale: $("corpus-stale"), reasons: $("corpus-reasons"),
    job: $("refresh-job"), jobProgress: $("refresh-progress"), jobState: $("refresh-state"),
    keyForm: $("key-form"), key: $("key"), keyWhy: $("key-why"), forgetKey: $("forget-key"),
    notice: $("notice"), chat: $("chat"), log: $("log"), empty: $("empty"),
    composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
    system: $("system"), maxTokens: $("max-tokens"), mode: $("mode"),
    temperature: $("temperature"), topP: $("top-p"), status: $("status"),
  };

  // The API key lives in this variable only: gone on reload or when the tab closes; never in the
  // URL or any storage.
  let apiKey = null;
  let corpora = [];
  let controller = null;     // AbortController of the answer being streamed
  let chat = null;           // the conversation shown: {id, title, corpus, created, updated, messages}
  let job = null;            // the refresh job this page started and follows
  let listing = null;        // the GET /v1/corpora in flight (polls join it)

  const STORE = { chats: "cag.chats.v1", active: "cag.active.v1", settings: "cag.settings.v1" };
  const POLL_MS = 30000;     // the corpus list (and so the stale badge) is read again this often

  // -- small helpers --------------------------------------------------------------------------
  function node(tag, cls, text) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined && text !== null) n.textContent = String(text);
    return n;
  }

  function button(text, cls, label) {
    const b = node("button", cls, text);
    b.type = "button";
    if (label) b.setAttribute("aria-label", label);
    return b;
  }

  function say(text) { el.status.textContent = text; }

  function notice(text) {
    el.notice.textContent = text || "";
    el.notice.hidden = !text;
  }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (apiKey) h["Authorization"] = "Bearer " + apiKey;
    return h;
  }

  async function errorText(res) {
    // the server's errors are {"error": {"message", "code"}}; anything else: the status line
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return res.status + " " + res.statusText;
  }

  function bytes(n) {
    if (!Number.isFinite(n)) return "";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];  // binary units, as the CLI prints them
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function ago(epochSeconds) {
    if (!epochSeconds) return "never";
    const s = Math.max(0, Date.now() / 1000 - epochSeconds);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return Math.round(s / 3600) + " h ago";
    return Math.round(s / 86400) + " days ago";
  }

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // -- markdown, made safe ----------------------------------------------------------------------
  const escapeHtml = (s) => String(s).replace(/[&<>"']/g,
    (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

  const PURIFY = {
    ALLOWED_TAGS: ["p", "br", "strong", "em", "del", "s", "code", "pre", "blockquote", "ul", "ol", "li",
                   "h1", "h2", "h3", "h4", "h5", "h6", "hr", "a", "table", "thead", "tbody", "tr", "th", "td"],
    ALLOWED_ATTR: ["href", "title", "start", "align"],
    ALLOW_DATA_ATTR: false, ALLOW_ARIA_ATTR: false,
    RETURN_DOM_FRAGMENT: true,  // nodes, not a string: nothing here assigns HTML to an element
  };

  const markdown = (() => {
    if (!window.marked || !window.marked.Marked || !window.DOMPurify || !window.DOMPurify.isSupported) return null;
    const md = new window.marked.Marked({ gfm: true, breaks: true, async: false });
    md.use({
      renderer: {
        // raw HTML in an answer (a document quoted, a model's whim) is shown as the text it is
        html(token) {
          const t = escapeHtml(token.text || "");
          return token.block ? "<p>" + t.replace(/\n/g, "<br>") + "</p>" : t;
        },
        // no images (the CSP allows none from elsewhere, and a URL would tell who reads): the alt text
        image(token) { return escapeHtml(token.text || token.href || ""); },
      },
    });
    window.DOMPurify.addHook("afterSanitizeAttributes", (n) => {
      if (n.tagName === "A" && n.hasAttribute("href")) {
        n.setAttribute("target", "_blank");
        n.setAttribute("rel", "noopener noreferrer");
      }
    });
    return md;
  })();

  function renderMarkdown(target, text) {
    if (!markdown) { target.textContent = text; return; }  // the libraries did not load: plain text
    try {
      target.replaceChildren(window.DOMPurify.sanitize(markdown.parse(text), PURIFY));
    } catch (_) {
      target.textContent = text;
    }
  }

  // -- the browser's storage (conversations, settings; never the key) -------------------------
  function readJSON(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null ? fallback : v;
    } catch (_) { return fallback; }
  }

  function writeJSON(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
      return true;
    } catch (err) {
      notice("This browser would not keep the conversation (" + err.name + "): it stays on screen until a reload.");
      return false;
    }
  }

  function validMessage(m) {
    return m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
  }

  function chats() {
    const all = readJSON(STORE.chats, []);
    if (!Array.isArray(all)) return [];
    return all.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages) && c.messages.every(validMessage));
  }

  function newId() {
    return Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 10);
  }

  function fresh() {
    return { id: newId(), title: "", corpus: el.corpus.value || "", created: Date.now(), updated: Date.now(), messages: [] };
  }

  function titleOf(c) {
    if (c.title) return c.title;
    const first = c.messages.find((m) => m.role === "user");
    return first ? first.content.replace(/\s+/g, " ").trim().slice(0, 80) : "New chat";
  }

  function store(conv) {
    // merged by id into what is stored now: another tab's conversations are kept
    const kept = conv.messages.filter((m) => !m.pending);
    if (conv.deleted || !kept.length) return;
    conv.updated = Date.now();
    const all = chats().filter((c) => c.id !== conv.id);
    all.push(Object.assign({}, conv, { messages: kept }));
    writeJSON(STORE.chats, all);
    if (conv === chat) writeJSON(STORE.active, chat.id);
    renderList();
  }

  function remove(id) {
    writeJSON(STORE.chats, chats().filter((c) => c.id !== id));
  }

  // -- settings --------------------------------------------------------------------------------
  const SETTINGS = { system: el.system, mode: el.mode, temperature: el.temperature, top_p: el.topP, max_tokens: el.maxTokens };

  function loadSettings() {
    const s = readJSON(STORE.settings, {});
    if (!s || typeof s !== "object") return;
    for (const [k, input] of Object.entries(SETTINGS)) {
      if (typeof s[k] !== "string") continue;
      if (input.tagName === "SELECT" && ![...input.options].some((o) => o.value === s[k])) continue;
      input.value = s[k];
    }
  }

  function saveSettings() {
    const s = {};
    for (const [k, input] of Object.entries(SETTINGS)) s[k] = input.value;
    writeJSON(STORE.settings, s);
  }

  for (const input of Object.values(SETTINGS)) input.addEventListener("change", saveSettings);
  el.system.addEventListener("input", saveSettings);

  function settings() {
    // what a request sends; null (and a notice) when a field is not a value the server takes
    const t = el.temperature.value.trim() === "" ? 0 : Number(el.temperature.value);
    if (!Number.isFinite(t) || t < 0 || t > 2) { notice("Temperature is a number from 0 to 2."); return null; }
    let topP = null;
    if (el.topP.value.trim() !== "") {
      topP = Number(el.topP.value);
      if (!Number.isFinite(topP) || topP <= 0 || topP > 1) { notice("Top-p is a number above 0, at most 1."); return null; }
    }
    const limit = el.maxTokens.value.trim() === "" ? null : Number(el.maxTokens.value);
    if (limit !== null && !(Number.isInteger(limit) && limit > 0)) {
      notice("The answer length limit is a whole number of tokens, at least 1.");
      return null;
    }
    return { system: el.system.value.trim(), mode: el.mode.value, temperature: t, top_p: topP, max_tokens: limit };
  }

  // -- the API key ----------------------------------------------------------------------------
  function askForKey(why) {
    el.keyWhy.textContent = why;
    el.keyForm.hidden = false;
    el.key.value = "";
    el.key.focus();
  }

  function refused(res, message) {
    // 401/403: the key is missing or refused; say so and ask again
    const had = apiKey !== null;
    apiKey = null;
    el.forgetKey.hidden = true;
    askForKey(had ? "The server refused this API key (" + res.status + "): " + message + " Enter another key."
                  : "This server needs an API key (" + res.status + ").");
    say(had ? "API key refused" : "API key needed");
  }

  el.keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const k = el.key.value.trim();
    if (!k) return;
    apiKey = k;
    el.key.value = "";
    el.keyForm.hidden = true;
    el.forgetKey.hidden = false;
    loadCorpora();
  });

  el.forgetKey.addEventListener("click", () => {
    apiKey = null;
    el.forgetKey.hidden = true;
    loadCorpora();
  });

  // -- corpora --------------------------------------------------------------------------------
  function loadCorpora(quiet) {
    // quiet: a poll (every POLL_MS, on focus): no "Loading", no notice when the server is away
    if (!listing) listing = listCorpora(quiet === true).finally(() => { listing = null; });
    return listing;
  }

  async function listCorpora(quiet) {
    if (!quiet) say("Loading corpora…");
    let res;
    try {
      res = await fetch("v1/corpora", { headers: headers(false), cache: "no-store" });
    } catch (err) {
      if (!quiet) notice("Cannot reach the server: " + err.message);
      return;
    }
    if (res.status === 401 || res.status === 403) { refused(res, await errorText(res)); return; }
    if (res.status === 503) {  // the model is still loading: try again shortly
      if (!quiet) {
        say("The server is loading its model…");
        setTimeout(loadCorpora, 1000);
      }
      return;
    }
    if (!res.ok) { if (!quiet) notice("Listing corpora failed: " + await errorText(res)); return; }
    const body = await res.json();
    if (!quiet) notice("");
    corpora = body.corpora || [];
    const previous = el.corpus.value;
    const names = corpora.map((c) => c.name);
    if (names.join("\n") !== [...el.corpus.options].map((o) => o.value).join("\n")) {
      el.corpus.replaceChildren(...names.map((n) => { const o = node("option"); o.value = n; return o; }));
    }
    corpora.forEach((c, i) => { el.corpus.options[i].textContent = c.stale ? c.name + " (stale)" : c.name; });
    if (previous && names.includes(previous)) el.corpus.value = previous;
    else if (chat.corpus && names.includes(chat.corpus)) el.corpus.value = chat.corpus;
    if (!chat.messages.length) chat.corpus = el.corpus.value;
    el.corpus.disabled = corpora.length === 0 || controller !== null;
    if (!corpora.length && !quiet) notice("No corpora on this server yet: run `cag ingest PATH`, then Reload list.");
    showCorpus();
    if (!quiet) say(corpora.length + (corpora.length === 1 ? " corpus" : " corpora"));
  }

  function selected() {
    return corpora.find((c) => c.name === el.corpus.value) || null;
  }

  function showCorpus() {
    const c = selected();
    el.info.hidden = !c;
    el.input.disabled = !c;
    el.send.disabled = !c || controller !== null;
    el.refresh.disabled = !c || job !== null;
    if (!c) return;
    el.size.textContent = c.n_documents + " documents · " + c.n_tokens.toLocaleString() + " tokens · " + bytes(c.bytes);
    el.fresh.textContent = "built " + ago(c.created) + " · last used " + ago(c.last_used);
    el.stale.hidden = !c.stale;
    el.reasons.replaceChildren(...(c.reasons || []).map((r) => node("li", null, r)));
    el.reasons.hidden = !c.stale || !(c.reasons || []).length;
    if (!job && el.job.dataset.corpus !== c.name) el.job.hidden = true;  // an old job's result
  }

  el.corpus.addEventListener("change", () => {
    if (chat.messages.length && chat.corpus !== el.corpus.value) newChat();  // a conversation is with one corpus
    chat.corpus = el.corpus.value;
    showCorpus();
  });
  el.reload.addEventListener("click", () => loadCorpora());

  // the stale badge follows the server: read the list again now and then, and when the tab is back
  setInterval(() => { if (!document.hidden) poll(); }, POLL_MS);
  window.addEventListener("focus", poll);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });

  function poll() {
    if (el.keyForm.hidden) loadCorpora(true);  // not while the page waits for a key
  }

  // -- refreshing a corpus (POST /v1/corpora/{name}/refresh, then GET /v1/jobs/{id}) ------------
  function showJob(corpus, text, progress, bad) {
    el.job.dataset.corpus = corpus;
    el.job.hidden = false;
    el.job.classList.toggle("bad", !!bad);
    el.jobState.textContent = text;
    el.jobProgress.hidden = progress === null;
    if (progress !== null) el.jobProgress.value = Math.max(0, Math.min(1, progress || 0));
  }

  function jobLine(info) {
    if (info.status === "queued" || !info.total_tokens) return "Refreshing " + info.corpus + ": reading its documents…";
    let line = "Refreshing " + info.corpus + ": " + Math.round(info.progress * 100) + "% · "
      + info.done_tokens.toLocaleString() + " of " + info.total_tokens.toLocaleString() + " tokens";
    if (info.reused_tokens) line += " (" + info.reused_tokens.toLocaleString() + " kept)";
    if (info.eta_s !== null && info.eta_s !== undefined) line += " · about " + Math.ceil(info.eta_s) + " s left";
    return line;
  }

  async function authFailed(res, corpus) {
    // 401: the key is missing or wrong; 403: not allowed (another site, a host not allowed)
    const msg = await errorText(res);
    showJob(corpus, "Refresh not allowed with " + (apiKey ? "this API key" : "no API key") + " (" + res.status + "): " + msg, null, true);
    if (res.status === 401) refused(res, msg);
  }

  async function refreshCorpus() {
    const c = selected();
    if (!c || job) return;
    job = c.name;
    showCorpus();
    showJob(c.name, "Asking the server to refresh " + c.name + "…", 0);
    try {
      let res = await fetch("v1/corpora/" + encodeURIComponent(c.name) + "/refresh",
                            { method: "POST", headers: headers(false), cache: "no-store" });
      if (res.status === 401 || res.status === 403) { await authFailed(res, c.name); return; }
      if (!res.ok) { showJob(c.name, "Refresh refused (" + res.status + "): " + await errorText(res), null, true); return; }
      let info = await res.json();
      while (info.status === "queued" || info.status === "running") {
        showJob(c.name, jobLine(info), info.progress);
        await sleep(500);
        res = await fetch("v1/jobs/" + encodeURIComponent(info.id), { headers: headers(false), cache: "no-store" });
        if (res.status === 401 || res.status === 403) { await authFailed(res, c.name); return; }
        if (!res.ok) { showJob(c.name, "Lost the refresh job: " + await errorText(res), null, true); return; }
        info = await res.json();
      }
      if (info.status === "done") {
        const r = info.result || {};
        let line = "Refreshed " + info.corpus;
        if (r.n_documents !== undefined) line += ": " + r.n_documents + " documents";
        if (r.n_tokens !== undefined) line += ", " + Number(r.n_tokens).toLocaleString() + " tokens";
        showJob(c.name, line, null);
        say(line);
      } else {
        const e = info.error || {};
        showJob(c.name, "Refresh of " + info.corpus + " failed" + (e.status ? " (" + e.status + ")" : "") + ": "
                + (e.message || "no reason given"), null, true);
      }
    } catch (err) {
      showJob(c.name, "Refresh: cannot reach the server: " + err.message, null, true);
    } finally {
      job = null;
      await loadCorpora(true);
      showCorpus();
    }
  }

  el.refresh.addEventListener("click", refreshCorpus);

  // -- the sidebar of conversations -----------------------------------------------------------
  function renderList() {
    const all = chats().sort((a, b) => (b.updated || 0) - (a.updated || 0));
    el.chatList.replaceChildren(...all.map((c) => {
      const li = node("li", "chat-item" + (c.id === chat.id ? " active" : ""));
      li.dataset.id = c.id;
      const open = button(null, "chat-open");
      open.append(node("span", "chat-title", titleOf(c)));
      if (c.corpus) open.append(node("span", "chat-corpus", c.corpus));
      if (c.id === chat.id) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => switchTo(c.id));
      const rename = button("✎", "chat-rename", "Rename this conversation");
      rename.addEventListener("click", () => renaming(li, c));
      const del = button("✕", "chat-delete", "Delete this conversation");
      del.addEventListener("click", () => deleting(del, c));
      li.append(open, rename, del);
      return li;
    }));
  }

  function renaming(li, c) {
    const input = node("input", "chat-rename-box");
    input.type = "text";
    input.value = titleOf(c);
    input.setAttribute("aria-label", "New name of the conversation");
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      const title = input.value.replace(/\s+/g, " ").trim().slice(0, 200);
      if (keep && title) {
        const all = chats();
        const stored = all.find((x) => x.id === c.id);
        if (stored) { stored.title = title; writeJSON(STORE.chats, all); }
        if (chat.id === c.id) chat.title = title;
        say("Renamed");
      }
      renderList();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
    li.replaceChildren(input);
    input.focus();
    input.select();
  }

  function deleting(b, c) {
    // a second click within a few seconds deletes (no dialog)
    if (b.dataset.confirm !== "1") {
      b.dataset.confirm = "1";
      b.textContent = "Delete?";
      b.setAttribute("aria-label", "Click again to delete this conversation");
      setTimeout(() => { if (b.isConnected) renderList(); }, 4000);
      return;
    }
    remove(c.id);
    if (chat.id === c.id) {
      chat.deleted = true;
      newChat();
    }
    renderList();
    say("Conversation deleted");
  }

  function switchTo(id) {
    if (id === chat.id) return;
    const c = chats().find((x) => x.id === id);
    if (!c) { renderList(); return; }
    if (controller) controller.abort();  // the answer so far is kept in its own conversation
    chat = c;
    writeJSON(STORE.active, chat.id);
    if (chat.corpus && corpora.some((x) => x.name === chat.corpus)) el.corpus.value = chat.corpus;
    else if (chat.corpus && corpora.length) {
      notice("This conversation was with the corpus " + JSON.stringify(chat.corpus)
             + ", which this server does not list: a question now goes to the corpus picked above.");
    }
    showCorpus();
    renderChat();
    closeSidebar();
    say("Conversation: " + titleOf(chat));
  }

  function newChat() {
    if (controller) controller.abort();
    chat = fresh();
    writeJSON(STORE.active, chat.id);
    renderChat();
    say("New chat");
    closeSidebar();
    el.input.focus();
  }

  el.newChat.addEventListener("click", newChat);

  // on a narrow screen the sidebar is a panel opened by the "Chats" button
  function closeSidebar() {
    document.body.classList.remove("chats-open");
    el.toggleChats.setAttribute("aria-expanded", "false");
  }
  el.toggleChats.addEventListener("click", () => {
    const open = document.body.classList.toggle("chats-open");
    el.toggleChats.setAttribute("aria-expanded", String(open));
    if (open) el.newChat.focus();
  });
  $("close-chats").addEventListener("click", () => { closeSidebar(); el.toggleChats.focus(); });
  el.sidebar.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && document.body.classList.contains("chats-open")) { closeSidebar(); el.toggleChats.focus(); }
  });

  // another tab changed the conversations: show its list (the conversation here is kept)
  window.addEventListener("storage", (e) => { if (e.key === STORE.chats) renderList(); });

  // -- the conversation -----------------------------------------------------------------------
  function renderChat() {
    el.log.replaceChildren(...chat.messages.map((m, i) => turnFor(m, i)));
    el.empty.hidden = chat.messages.length > 0;
    renderList();
  }

  function follow() {
    // stay at the end unless the reader scrolled up
    return el.chat.scrollHeight - el.chat.scrollTop - el.chat.clientHeight < 48;
  }

  function turnFor(m, i) {
    const li = node("li", "turn " + m.role);
    li.append(node("div", "who", m.role === "user" ? "You" : "Answer"));
    const body = node("div", m.role === "user" ? "text" : "text md");
    li.append(body);
    if (m.role === "user") {
      body.textContent = m.content;
      if (!controller) userActions(li, body, i);
      return li;
    }
    renderMarkdown(body, m.content);
    if (m.pending) { li.setAttribute("aria-busy", "true"); return li; }
    if (m.stopped) li.append(node("div", "stopped", "Stopped"));
    if (m.error) {
      li.classList.add("failed");
      li.append(node("div", "error", m.error));
    }
    meta(li, m.usage, m.ext);
    sources(li, m.ext);
    const actions = node("div", "turn-actions");
    if (m.content) actions.append(copyButton(body, m.content));
    if (i === chat.messages.length - 1 && !controller) {
      const again = button(m.error || !m.content ? "Retry" : "Regenerate", "regenerate", "Answer this question again");
      again.addEventListener("click", () => regenerate(i));
      actions.append(again);
    }
    if (actions.childNodes.length) li.append(actions);
    return li;
  }

  function userActions(li, body, i) {
    const actions = node("div", "turn-actions");
    const edit = button("Edit", "edit", "Edit this question and ask it again");
    edit.addEventListener("click", () => editing(li, body, i));
    actions.append(edit);
    if (i === chat.messages.length - 1) {  // a question left without an answer (a reload mid-answer)
      const again = button("Answer", "regenerate", "Answer this question");
      again.addEventListener("click", () => regenerate(i + 1));
      actions.append(again);
    }
    li.append(actions);
  }

  function editing(li, body, i) {
    if (controller) return;
    const box = node("textarea", "edit-box");
    box.value = chat.messages[i].content;
    box.rows = Math.min(8, Math.max(2, box.value.split("\n").length));
    box.setAttribute("aria-label", "Edit the question");
    const send = button("Send", "edit-send", "Send the edited question: the turns after it are dropped");
    const cancel = button("Cancel", "edit-cancel");
    const form = node("div", "edit-form");
    const actions = node("div", "turn-actions");
    actions.append(send, cancel);
    form.append(box, actions);
    for (const a of li.querySelectorAll(".turn-actions")) a.remove();
    body.replaceWith(form);
    const submit = () => {
      const q = box.value.trim();
      if (!q || controller || !selected() || !settings()) return;
      chat.messages = chat.messages.slice(0, i);  // the turns after the edited question go
      chat.messages.push({ role: "user", content: q });
      answer(chat);
    };
    send.addEventListener("click", submit);
    cancel.addEventListener("click", () => renderChat());
    box.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
      if (e.key === "Escape") { e.preventDefault(); renderChat(); }
    });
    box.focus();
  }

  function regenerate(i) {
    // the answer at i (or, past the end, none) goes; its question is asked again
    if (controller || !selected() || !settings()) return;
    chat.messages = chat.messages.slice(0, i);
    answer(chat);
  }

  function requestMessages(msgs, system) {
    // what the model sees: the system message, each question that has an answer (shown, stopped or
    // broken off: what the reader saw), and last the question to answer; a question left without
    // any answer text is left out
    const out = system ? [{ role: "system", content: system }] : [];
    for (let i = 0; i < msgs.length; i++) {
      const m = msgs[i];
      if (m.role !== "user") continue;
      const next = msgs[i + 1];
      if (i === msgs.length - 1) out.push({ role: "user", content: m.content });
      else if (next && next.role === "assistant") {
        if (next.content) out.push({ role: "user", content: m.content }, { role: "assistant", content: next.content });
        i++;
      }
    }
    return out;
  }

  function streaming(on) {
    el.stop.disabled = !on;
    el.send.disabled = on || !selected();
    el.corpus.disabled = on || corpora.length === 0;
  }

  // Server-sent events from a fetch body: yields the `data` of each event ("[DONE]" included).
  async function* sse(body, signal) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
          const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      if (signal.aborted) reader.cancel().catch(() => {});
      reader.releaseLock();
    }
  }

  function meta(li, usage, ext) {
    const m = node("div", "meta");
    if (usage) {
      const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
      if (cached !== null && cached !== undefined) {
        let line = "cached " + cached + " of " + usage.prompt_tokens + " prompt tokens";
        const split = ext && ext.cached_tokens;  // where they came from: the snapshot, the kept conversation
        if (split && typeof split === "object" && split.conversation) {
          line += " (" + split.snapshot + " snapshot + " + split.conversation + " conversation)";
        }
        m.append(node("span", "cached", line));
      }
      m.append(node("span", "completion", usage.completion_tokens + " answer tokens"));
    }
    if (ext && ext.timings && ext.timings.ttft_ms !== undefined) {
      m.append(node("span", "ttft", "TTFT " + Math.round(ext.timings.ttft_ms) + " ms"));
    }
    if (ext && ext.timings && ext.timings.decode_tok_s) {
      m.append(node("span", "rate", Number(ext.timings.decode_tok_s).toFixed(1) + " tok/s"));
    }
    if (ext && Array.isArray(ext.shards) && ext.shards.length) {
      const chosen = ext.shards.filter((s) => s.chosen !== false).map((s) => "shard " + s.shard);
      m.append(node("span", "shards", "from " + (chosen.length ? chosen : ext.shards.map((s) => "shard " + s.shard)).join(", ")));
    }
    if (ext && ext.mode) m.append(node("span", "mode", "mode " + ext.mode));
    if (ext && ext.snapshot) m.append(node("span", "snapshot", "snapshot " + String(ext.snapshot).slice(0, 12)));
    if (m.childNodes.length) li.append(m);
    if (ext && ext.stale) {
      const w = node("div", "stale-warning", "Warning: the snapshot is stale");
      w.setAttribute("role", "note");
      const reasons = ext.stale_reasons || [];
      if (reasons.length) w.append(node("span", null, ": " + reasons.join("; ")));
      li.append(w);
    }
  }

  function sources(li, ext) {
    // what the answer read besides the snapshot (rag, cag+rag: passages, by document name and
    // passage number); a cag answer read the whole cached corpus
    const docs = ext && (ext.passages || ext.documents);
    if (!Array.isArray(docs) || !docs.length) return;
    const names = docs.map((d) => (typeof d === "string" ? d : d && (d.name || d.document || d.doc_id))).filter(Boolean);
    if (!names.length) return;
    const box = node("div", "sources");
    box.append(node("span", "sources-label", names.length === 1 ? "Source" : "Sources (" + names.length + ")"));
    const ul = node("ul");
    ul.append(...names.map((n) => node("li", null, n)));
    box.append(ul);
    li.append(box);
  }

  function copyButton(body, text) {
    const b = button("Copy", "copy", "Copy this answer (its markdown)");
    b.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(text);
      } catch (_) {  // no clipboard API (plain http on another host): select the text instead
        const range = document.createRange();
        range.selectNodeContents(body);
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        try { document.execCommand("copy"); } catch (__) { /* the text stays selected */ }
      }
      b.textContent = "Copied";
      say("Answer copied");
      setTimeout(() => { b.textContent = "Copy"; }, 1500);
    });
    return b;
  }

  async function answer(conv) {
    // conv.messages ends with the question to answer; the answer streams into a new turn
    const c = selected();
    const opts = settings();
    if (!c || controller || !opts) return;
    notice("");
    const body = { model: c.name, messages: requestMessages(conv.messages, opts.system), stream: true,
                   stream_options: { include_usage: true }, temperature: opts.temperature };
    if (opts.top_p !== null) body.top_p = opts.top_p;
    if (opts.max_tokens) body.max_tokens = opts.max_tokens;
    if (opts.mode !== "cag") body.mode = opts.mode;
    conv.corpus = c.name;
    const msg = { role: "assistant", content: "", pending: true };
    conv.messages.push(msg);
    store(conv);  // the question is kept even if the tab closes before the answer
    controller = new AbortController();
    const signal = controller.signal;
    streaming(true);
    renderChat();
    const li = el.log.lastElementChild;
    const target = li.querySelector(".text");
    li.scrollIntoView({ block: "end" });
    say("Answering…");

    let text = "", usage = null, ext = null, failure = null, stopped = false, ended = false;
    try {
      const res = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
      });
      if (res.status === 401 || res.status === 403) {
        const why = await errorText(res);
        refused(res, why);
        failure = "Refused (" + res.status + "): " + why;
      } else if (!res.ok) {
        failure = "Error " + res.status + ": " + await errorText(res);
      } else {
        for await (const data of sse(res.body, signal)) {
          if (data === "[DONE]") { ended = true; break; }
          const chunk = JSON.parse(data);
          if (chunk.error) { failure = "Error: " + chunk.error.message; ended = true; break; }
          if (chunk.usage) { usage = chunk.usage; ext = chunk.cag || null; }
          const choice = chunk.choices && chunk.choices[0];
          const piece = choice && choice.delta && choice.delta.content;
          if (piece) {
            const keep = follow();
            text += piece;
            msg.content = text;
            if (conv === chat) renderMarkdown(target, text);
            if (keep) el.chat.scrollTop = el.chat.scrollHeight;
            if (text === piece) say("Answering… first token in");
          }
        }
        if (!ended) failure = "The answer broke off: the stream ended early.";
      }
    } catch (err) {
      if (err.name === "AbortError") stopped = true;
      else failure = "The answer broke off: " + err.message;
    }

    // what was shown stays: a stopped or broken answer keeps its text, with the reason under it
    controller = null;
    delete msg.pending;
    msg.content = text;
    if (usage) msg.usage = usage;
    if (ext) msg.ext = ext;
    if (stopped) msg.stopped = true;
    if (failure) msg.error = failure;
    streaming(false);
    store(conv);
    if (conv !== chat) return;  // another conversation is shown now
    const keep = follow();
    renderChat();
    if (keep) el.chat.scrollTop = el.chat.scrollHeight;
    say(failure ? failure + (text ? " (the answer so far is kept)" : "") : stopped ? "Stopped" : "Answer complete");
    el.input.focus();
  }

  el.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = el.input.value.trim();
    if (!q || controller || !selected() || !settings()) return;
    el.input.value = "";
    chat.messages.push({ role: "user", content: q });
    answer(chat);
  });

  el.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      el.composer.requestSubmit();
    }
  });

  el.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) { e.preventDefault(); controller.abort(); }
  });

  // -- start: settings and the last conversation from this browser, then the corpora -----------
  loadSettings();
  const active = readJSON(STORE.active, null);
  chat = chats().find((c) => c.id === active) || fresh();
  renderChat();
  loadCorpora().then(() => { if (!el.input.disabled) el.input.focus(); });
})();
