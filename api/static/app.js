// cag chat page: pick a corpus, chat with it over POST /v1/chat/completions (streamed).
// Plain script, no build step, no library. Everything that comes from the server (answers,
// corpus and document names, reasons, errors) is put in the page with textContent, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    corpus: $("corpus"), reload: $("reload"), newChat: $("new-chat"),
    info: $("corpus-info"), size: $("corpus-size"), fresh: $("corpus-fresh"),
    stale: $("corpus-stale"), reasons: $("corpus-reasons"),
    keyForm: $("key-form"), key: $("key"), keyWhy: $("key-why"), forgetKey: $("forget-key"),
    notice: $("notice"), log: $("log"), empty: $("empty"),
    composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
    system: $("system"), maxTokens: $("max-tokens"), mode: $("mode"), status: $("status"),
  };

  // The API key lives in this variable only: gone on reload or when the tab closes; never in the
  // URL, localStorage or sessionStorage.
  let apiKey = null;
  let corpora = [];
  let history = [];          // [{role: "user" | "assistant", content}] of this conversation
  let controller = null;     // AbortController of the answer being streamed
  let conversation = 0;      // bumped by "New chat": a late answer of an old chat is dropped

  // -- small helpers --------------------------------------------------------------------------
  function node(tag, cls, text) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined && text !== null) n.textContent = String(text);
    return n;
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
  async function loadCorpora() {
    say("Loading corpora…");
    let res;
    try {
      res = await fetch("v1/corpora", { headers: headers(false), cache: "no-store" });
    } catch (err) {
      notice("Cannot reach the server: " + err.message);
      return;
    }
    if (res.status === 401 || res.status === 403) { refused(res, await errorText(res)); return; }
    if (res.status === 503) {  // the model is still loading: try again shortly
      say("The server is loading its model…");
      setTimeout(loadCorpora, 1000);
      return;
    }
    if (!res.ok) { notice("Listing corpora failed: " + await errorText(res)); return; }
    const body = await res.json();
    notice("");
    corpora = body.corpora || [];
    const previous = el.corpus.value;
    el.corpus.replaceChildren();
    for (const c of corpora) {
      const o = node("option", null, c.stale ? c.name + " (stale)" : c.name);
      o.value = c.name;
      el.corpus.append(o);
    }
    if (corpora.some((c) => c.name === previous)) el.corpus.value = previous;
    el.corpus.disabled = corpora.length === 0;
    if (!corpora.length) notice("No corpora on this server yet: run `cag ingest PATH`, then Reload list.");
    showCorpus();
    say(corpora.length + (corpora.length === 1 ? " corpus" : " corpora"));
  }

  function selected() {
    return corpora.find((c) => c.name === el.corpus.value) || null;
  }

  function showCorpus() {
    const c = selected();
    el.info.hidden = !c;
    el.input.disabled = !c;
    el.send.disabled = !c || controller !== null;
    if (!c) return;
    el.size.textContent = c.n_documents + " documents · " + c.n_tokens.toLocaleString() + " tokens · " + bytes(c.bytes);
    el.fresh.textContent = "built " + ago(c.created) + " · last used " + ago(c.last_used);
    el.stale.hidden = !c.stale;
    el.reasons.replaceChildren(...(c.reasons || []).map((r) => node("li", null, r)));
    el.reasons.hidden = !c.stale || !(c.reasons || []).length;
  }

  el.corpus.addEventListener("change", () => { newChat(); showCorpus(); });
  el.reload.addEventListener("click", loadCorpora);

  // -- the conversation -----------------------------------------------------------------------
  function newChat() {
    if (controller) controller.abort();
    conversation++;
    history = [];
    el.log.replaceChildren();
    el.empty.hidden = false;
    say("New chat");
    el.input.focus();
  }

  el.newChat.addEventListener("click", newChat);

  function addTurn(role, text) {
    el.empty.hidden = true;
    const li = node("li", "turn " + role);
    li.append(node("div", "who", role === "user" ? "You" : "Answer"));
    const body = node("div", "text", text);
    li.append(body);
    el.log.append(li);
    li.scrollIntoView({ block: "end" });
    return { li, body };
  }

  function messages() {
    const out = [];
    const system = el.system.value.trim();
    if (system) out.push({ role: "system", content: system });
    return out.concat(history);
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

  function meta(turn, usage, ext) {
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
      m.append(node("span", "rate", ext.timings.decode_tok_s.toFixed(1) + " tok/s"));
    }
    if (ext && Array.isArray(ext.shards) && ext.shards.length) {
      const chosen = ext.shards.filter((s) => s.chosen !== false).map((s) => "shard " + s.shard);
      m.append(node("span", "shards", "from " + (chosen.length ? chosen : ext.shards.map((s) => "shard " + s.shard)).join(", ")));
    }
    const docs = ext && (ext.documents || ext.passages);
    if (Array.isArray(docs) && docs.length) {
      const names = docs.map((d) => (typeof d === "string" ? d : d.name || d.document || d.doc_id)).filter(Boolean);
      if (names.length) m.append(node("span", "documents", "documents: " + names.join(", ")));
    }
    if (ext && ext.mode) m.append(node("span", "mode", "mode " + ext.mode));
    if (ext && ext.snapshot) m.append(node("span", "snapshot", "snapshot " + String(ext.snapshot).slice(0, 12)));
    turn.li.append(m);
    if (ext && ext.stale) {
      const w = node("div", "stale-warning", "Warning: the snapshot is stale");
      w.setAttribute("role", "note");
      const reasons = ext.stale_reasons || [];
      if (reasons.length) w.append(node("span", null, ": " + reasons.join("; ")));
      turn.li.append(w);
    }
  }

  function copyButton(turn) {
    const b = node("button", "copy", "Copy");
    b.type = "button";
    b.setAttribute("aria-label", "Copy this answer");
    b.addEventListener("click", async () => {
      const text = turn.body.textContent;
      try {
        await navigator.clipboard.writeText(text);
      } catch (_) {  // no clipboard API (plain http on another host): select the text instead
        const range = document.createRange();
        range.selectNodeContents(turn.body);
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        try { document.execCommand("copy"); } catch (__) { /* the text stays selected */ }
      }
      b.textContent = "Copied";
      say("Answer copied");
      setTimeout(() => { b.textContent = "Copy"; }, 1500);
    });
    turn.li.append(b);
  }

  async function ask(question) {
    const c = selected();
    if (!c || controller) return;
    notice("");
    history.push({ role: "user", content: question });
    addTurn("user", question);
    const turn = addTurn("assistant", "");
    turn.li.setAttribute("aria-busy", "true");
    const mine = conversation;
    controller = new AbortController();
    const signal = controller.signal;
    streaming(true);
    say("Answering…");

    const body = { model: c.name, messages: messages(), stream: true,
                   stream_options: { include_usage: true }, temperature: 0 };
    if (el.mode.value !== "cag") body.mode = el.mode.value;
    const limit = parseInt(el.maxTokens.value, 10);
    if (limit > 0) body.max_tokens = limit;

    let text = "", usage = null, ext = null, failure = null, stopped = false, ended = false;
    try {
      const res = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
      });
      if (res.status === 401 || res.status === 403) {
        const msg = await errorText(res);
        refused(res, msg);
        failure = "Refused (" + res.status + "): " + msg;
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
            const chat = el.log.parentElement;  // follow the answer unless the reader scrolled up
            const follow = chat.scrollHeight - chat.scrollTop - chat.clientHeight < 48;
            text += piece;
            turn.body.append(document.createTextNode(piece));
            if (follow) chat.scrollTop = chat.scrollHeight;
            if (text === piece) say("Answering… first token in");
          }
        }
        if (!ended) failure = "The answer broke off: the stream ended early.";
      }
    } catch (err) {
      if (err.name === "AbortError") stopped = true;
      else failure = "The answer broke off: " + err.message;
    }

    controller = null;
    streaming(false);
    turn.li.removeAttribute("aria-busy");
    if (mine !== conversation) return;  // "New chat" was pressed meanwhile
    if (failure) {
      turn.li.classList.add("failed");
      turn.body.textContent = failure;
      history.pop();  // the question was not answered: not part of the conversation
      if (!el.input.value) el.input.value = question;
      say(failure);
    } else {
      if (stopped) {
        turn.li.append(node("div", "stopped", "Stopped"));
        say("Stopped");
      } else {
        say("Answer complete");
      }
      meta(turn, usage, ext);
      if (text) {
        history.push({ role: "assistant", content: text });
        copyButton(turn);
      } else {
        history.pop();  // stopped before the first token: nothing to answer to
      }
    }
    el.input.focus();
  }

  el.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = el.input.value.trim();
    if (!q || controller || !selected()) return;
    el.input.value = "";
    ask(q);
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

  loadCorpora().then(() => { if (!el.input.disabled) el.input.focus(); });
})();
