// GGUF Swarm playground: the chat page over the JSON websocket /ws/chat/ (docs/control-plane.md).
// Answers are Markdown rendered in the browser as tokens stream: markdown-it with raw HTML off, then
// DOMPurify on its output, so whatever a model writes (a <script> included) is shown, never run.
(function () {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const state = JSON.parse($("pg-state").textContent);
  const md = window.markdownit({ html: false, linkify: true, breaks: false });
  const el = {
    list: $("pg-list"), listEmpty: $("pg-list-empty"), title: $("pg-title"), model: $("pg-model"),
    conn: $("pg-conn"), banner: $("pg-banner"), messages: $("pg-messages"), empty: $("pg-empty"),
    form: $("pg-form"), input: $("pg-input"), send: $("pg-send"), stop: $("pg-stop"),
    system: $("pg-system"), maxTokens: $("pg-max_tokens"), contextNote: $("pg-context-note"),
    route: $("pg-route"),
  };
  const SAMPLING = ["temperature", "top_p", "top_k", "seed", "min_p", "repeat_penalty"];

  let ws = null;
  let retryMs = 500;
  let current = { id: null, title: "New chat" };
  let conversations = state.conversations.slice();
  let pending = null; // the turn being answered: {userEl, answerEl, raw, text, rendered}

  // -- rendering ---------------------------------------------------------------------------------
  function sanitize(html) {
    return window.DOMPurify.sanitize(html, { USE_PROFILES: { html: true }, FORBID_TAGS: ["style", "form"] });
  }

  function renderMarkdown(target, text) {
    target.innerHTML = sanitize(md.render(text));
    target.querySelectorAll("pre > code").forEach((code) => {
      const pre = code.parentElement;
      const box = document.createElement("div");
      box.className = "codeblock";
      const bar = document.createElement("div");
      bar.className = "codeblock-bar";
      const lang = (code.className.match(/language-([\w+-]+)/) || [])[1] || "code";
      const label = document.createElement("span");
      label.textContent = lang;
      bar.append(label, copyButton(() => code.textContent, "Copy code"));
      pre.replaceWith(box);
      box.append(bar, pre);
    });
    target.querySelectorAll("a[href]").forEach((a) => { a.target = "_blank"; a.rel = "noopener noreferrer"; });
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    const area = document.createElement("textarea"); // plain-http hosts have no clipboard API
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
    return Promise.resolve();
  }

  function copyButton(getText, label) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "copy";
    b.textContent = label;
    b.addEventListener("click", () => {
      copyText(getText()).then(() => {
        b.textContent = "Copied";
        setTimeout(() => { b.textContent = label; }, 1200);
      });
    });
    return b;
  }

  function bubble(role, text, opts = {}) {
    el.empty.hidden = true;
    const wrap = document.createElement("div");
    wrap.className = `msg ${role}`;
    const body = document.createElement("div");
    body.className = "msg-body";
    wrap.append(body);
    if (role === "user") {
      body.textContent = text;
    } else {
      wrap.dataset.raw = text;
      if (text) renderMarkdown(body, text);
      const foot = document.createElement("div");
      foot.className = "msg-foot";
      const tel = document.createElement("div");
      tel.className = "telemetry";
      foot.append(tel, copyButton(() => wrap.dataset.raw || "", "Copy"));
      wrap.append(foot);
      if (opts.telemetry) showTelemetry(wrap, opts.telemetry, opts.bars || barsFrom(opts.telemetry), opts.stopped);
    }
    el.messages.append(wrap);
    wrap.scrollIntoView({ block: "end" });
    return wrap;
  }

  function fmt(x, digits) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }

  // The server sends bars with each progress and done event; a stored answer has only its telemetry.
  function barsFrom(t) {
    const hops = (t && t.hops) || [];
    const scale = Math.max(1e-9, ...hops.map((h) => (h.compute_ms || 0) + (h.network_ms || 0)));
    return hops.map((h) => ({
      url: h.url, layers: Array.isArray(h.layers) ? `${h.layers[0]}–${h.layers[1]}` : String(h.layers || ""),
      compute_ms: h.compute_ms || 0, network_ms: h.network_ms || 0,
      compute_pct: (100 * (h.compute_ms || 0)) / scale, network_pct: (100 * (h.network_ms || 0)) / scale,
    }));
  }

  function showTelemetry(wrap, t, bars, stopped, live) {
    const tel = wrap.querySelector(".telemetry");
    if (!tel) return;
    const has = (k) => t[k] !== undefined && t[k] !== null;
    const parts = [];
    if (stopped) {
      parts.push(`stopped after ${has("n_generated") ? t.n_generated : "?"} tokens`);
      if (t.route_closed) parts.push("the route was closed");
    } else if (live) {
      parts.push(`${t.n_generated} tokens`, `${fmt(t.tok_s, 1)} tok/s`, `${fmt(t.total_ms / 1000, 1)} s`);
    } else {
      if (has("ttft_ms")) parts.push(`TTFT ${fmt(t.ttft_ms, 0)} ms`);
      if (has("tok_s")) parts.push(`${fmt(t.tok_s, 1)} tok/s`);
      if (has("n_prompt")) {
        const reuse = t.n_reused ? ` (${t.n_reused} reused from the hops' KV, ${t.n_prefilled} sent)` : "";
        parts.push(`${t.n_prompt} prompt tokens${reuse}`);
      }
      // a system prompt some earlier session (anyone's) left on the hops, restored instead of prefilled
      if (t.prefix_hit) parts.push(`system prompt restored (${t.prefix_shared_tokens} tokens)`);
      if (has("n_generated")) parts.push(`${t.n_generated} generated`);
      // speculative decoding: drafts the route verified and kept, tokens per round trip of the route
      const sp = t.speculation;
      if (sp && sp.verify_steps) {
        parts.push(`${fmt(sp.tokens_per_round_trip, 2)} tokens per round trip (${sp.accepted} of ${sp.drafted} drafts kept)`);
      }
    }
    const line = parts.join(" · ");
    let hops = tel.querySelector(".hops");
    if (!hops) {
      tel.innerHTML = '<div class="tel-line"></div><div class="hops"></div>';
      hops = tel.querySelector(".hops");
    }
    tel.querySelector(".tel-line").textContent = line;
    tel.classList.toggle("stopped", !!stopped);
    // Rows are kept and only their widths change, so the bars glide while the answer streams.
    while (hops.children.length > bars.length) hops.lastChild.remove();
    bars.forEach((b, i) => {
      let row = hops.children[i];
      if (!row) {
        row = document.createElement("div");
        row.className = "hop";
        row.innerHTML = '<span class="hop-label"></span><span class="hop-bar"><span class="compute"></span>' +
          '<span class="network"></span></span><span class="hop-ms muted"></span>';
        hops.append(row);
      }
      row.querySelector(".hop-label").textContent = `layers ${b.layers}`;
      row.querySelector(".hop-label").title = b.url;
      row.querySelector(".compute").style.width = `${b.compute_pct.toFixed(1)}%`;
      row.querySelector(".network").style.width = `${b.network_pct.toFixed(1)}%`;
      row.querySelector(".hop-ms").textContent = `${fmt(b.compute_ms, 0)} + ${fmt(b.network_ms, 0)} ms`;
    });
  }

  function banner(text) {
    el.banner.textContent = text || "";
    el.banner.hidden = !text;
  }

  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.hidden = !busy;
    el.stop.disabled = false;
  }

  // -- conversations -----------------------------------------------------------------------------
  function drawList() {
    el.list.replaceChildren();
    el.listEmpty.hidden = conversations.length > 0;
    conversations.forEach((c) => {
      const li = document.createElement("li");
      li.className = "conv" + (c.id === current.id ? " active" : "");
      li.dataset.id = c.id;
      const a = document.createElement("a");
      a.href = `?c=${c.id}`;
      a.className = "conv-title";
      a.textContent = c.title || "Untitled";
      a.addEventListener("click", (e) => { e.preventDefault(); openConversation(c.id); });
      const ren = document.createElement("button");
      ren.type = "button"; ren.className = "icon rename"; ren.title = "Rename"; ren.textContent = "✎";
      ren.addEventListener("click", () => startRename(li, c));
      const del = document.createElement("button");
      del.type = "button"; del.className = "icon delete"; del.title = "Delete"; del.textContent = "×";
      del.addEventListener("click", () => deleteConversation(c));
      li.append(a, ren, del);
      el.list.append(li);
    });
  }

  async function post(url, data) {
    const r = await fetch(url, {
      method: "POST",
      headers: { "X-CSRFToken": $("pg-csrf").value },
      body: new URLSearchParams(data || {}),
    });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
    return body;
  }

  function startRename(li, c) {
    const input = document.createElement("input");
    input.className = "conv-rename";
    input.value = c.title;
    li.replaceChildren(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      if (save && input.value.trim() && input.value.trim() !== c.title) {
        try {
          const s = await post(`conversations/${c.id}/rename`, { title: input.value });
          c.title = s.title;
          if (current.id === c.id) setTitle(s.title);
        } catch (e) { banner(`rename failed: ${e.message}`); }
      }
      drawList();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      if (e.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  async function deleteConversation(c) {
    if (!window.confirm(`Delete “${c.title}”?`)) return;
    try {
      await post(`conversations/${c.id}/delete`);
    } catch (e) { banner(`delete failed: ${e.message}`); return; }
    conversations = conversations.filter((x) => x.id !== c.id);
    if (current.id === c.id) newChat(); else drawList();
  }

  function setTitle(t) { current.title = t; el.title.textContent = t; document.title = `${t} · Playground`; }

  function setUrl(id) {
    const url = new URL(window.location.href);
    if (id) url.searchParams.set("c", id); else url.searchParams.delete("c");
    window.history.replaceState(null, "", url);
  }

  function clearMessages() {
    el.messages.replaceChildren(el.empty);
    el.empty.hidden = false;
  }

  function newChat() {
    if (pending) return;
    current = { id: null, title: "New chat" };
    setTitle("New chat");
    clearMessages();
    setUrl(null);
    el.route.textContent = "Opens with your first message.";
    banner("");
    drawList();
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "reset" }));
    el.input.focus();
  }

  async function openConversation(id) {
    if (pending) return;
    const r = await fetch(`conversations/${id}.json`);
    if (!r.ok) { banner("that conversation is gone"); setUrl(null); return; }
    const c = await r.json();
    current = { id: c.id, title: c.title };
    setTitle(c.title);
    clearMessages();
    banner("");
    el.system.value = c.system_prompt || "";
    const s = c.settings || {};
    SAMPLING.forEach((k) => { if (s[k] !== undefined) $(`pg-${k}`).value = s[k]; });
    if (s.max_tokens) el.maxTokens.value = s.max_tokens;
    if (c.model && el.model.querySelector(`option[value="${c.model}"]`)) el.model.value = String(c.model);
    modelChanged();
    c.messages.forEach((m) => bubble(m.role, m.content, m.role === "assistant"
      ? { telemetry: m.telemetry, stopped: m.stopped } : {}));
    setUrl(c.id);
    drawList();
  }

  // -- model controls ----------------------------------------------------------------------------
  function modelChanged() {
    const opt = el.model.selectedOptions[0];
    const ctx = opt ? parseInt(opt.dataset.context || "0", 10) : 0;
    if (ctx) {
      el.maxTokens.max = ctx;
      if (parseInt(el.maxTokens.value, 10) > ctx) el.maxTokens.value = ctx;
      el.contextNote.textContent = `(up to ${ctx.toLocaleString("en")}, the model's context)`;
    }
    if (opt && opt.dataset.placed === "0") {
      banner(`${opt.dataset.name || opt.textContent} is not placed on any node yet, so it cannot answer; an admin places it from the Models page.`);
    } else if (el.banner.dataset.kind !== "turn") banner("");
  }

  // -- the socket --------------------------------------------------------------------------------
  function connect() {
    const proto = window.location.protocol === "https:" ? "wss" : "ws";
    ws = new WebSocket(`${proto}://${window.location.host}/ws/chat/`);
    ws.addEventListener("open", () => {
      retryMs = 500;
      el.conn.textContent = "connected";
      el.conn.className = "pg-conn ok";
    });
    ws.addEventListener("close", () => {
      el.conn.textContent = "reconnecting…";
      el.conn.className = "pg-conn bad";
      if (pending) finishTurn(null, "the connection to the server dropped; the answer so far is kept");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    });
    ws.addEventListener("message", (e) => onEvent(JSON.parse(e.data)));
  }

  let renderQueued = false;
  function queueRender() {
    if (renderQueued) return;
    renderQueued = true;
    window.requestAnimationFrame(() => {
      renderQueued = false;
      if (!pending) return;
      renderMarkdown(pending.answerEl.querySelector(".msg-body"), pending.answerEl.dataset.raw);
      pending.answerEl.classList.toggle("typing", false);
      pending.answerEl.scrollIntoView({ block: "end" });
    });
  }

  function finishTurn(ev, error) {
    const p = pending;
    pending = null;
    setBusy(false);
    if (!p) return;
    if (ev) {
      p.answerEl.dataset.raw = ev.text;
      renderMarkdown(p.answerEl.querySelector(".msg-body"), ev.text);
      showTelemetry(p.answerEl, ev.telemetry, ev.bars && ev.bars.length ? ev.bars : barsFrom(ev.telemetry), ev.stopped);
      p.answerEl.classList.remove("typing");
      p.answerEl.classList.toggle("stopped", !!ev.stopped);
      p.answerEl.dataset.done = "1";
    } else if (!p.answerEl.dataset.raw) {
      p.answerEl.remove(); // no answer at all: the server forgot the turn, so the text goes back
      p.userEl.remove();
      if (!el.input.value) el.input.value = p.message;
      if (!el.messages.querySelector(".msg")) el.empty.hidden = false;
    } else {
      p.answerEl.classList.remove("typing");
    }
    if (error) { banner(error); el.banner.dataset.kind = "turn"; }
  }

  function onEvent(ev) {
    switch (ev.type) {
      case "start": {
        if (!pending) return;
        current.id = ev.conversation;
        setTitle(ev.title);
        if (!conversations.some((c) => c.id === ev.conversation)) {
          conversations.unshift({ id: ev.conversation, title: ev.title });
        }
        setUrl(ev.conversation);
        drawList();
        el.route.textContent = "";
        ev.route.forEach((h, i) => {
          const d = document.createElement("div");
          d.textContent = `${i + 1}. ${h.node} · layers [${h.layer_start}, ${h.layer_end})`;
          el.route.append(d);
        });
        break;
      }
      case "delta":
        if (!pending) return;
        pending.answerEl.dataset.raw += ev.text;
        queueRender();
        break;
      case "progress":
        if (pending) showTelemetry(pending.answerEl, ev.telemetry, ev.bars, false, true);
        break;
      case "done": {
        finishTurn(ev, null);
        const i = conversations.findIndex((c) => c.id === ev.conversation);
        if (i > 0) conversations.unshift(...conversations.splice(i, 1));
        drawList();
        break;
      }
      case "error":
        if (pending && ev.turn !== undefined) finishTurn(null, ev.error);
        else banner(ev.error);
        break;
      default:
        break;
    }
  }

  function send() {
    const text = el.input.value;
    if (!text.trim() || pending) return;
    if (!ws || ws.readyState !== WebSocket.OPEN) { banner("not connected to the server yet; try again in a moment"); return; }
    if (!el.model.value) { banner("no model is ready yet"); return; }
    banner("");
    delete el.banner.dataset.kind;
    const msg = {
      type: "chat", model: el.model.value, conversation: current.id, message: text,
      system: el.system.value, max_tokens: el.maxTokens.value,
    };
    SAMPLING.forEach((k) => { msg[k] = $(`pg-${k}`).value; });
    ws.send(JSON.stringify(msg));
    const userEl = bubble("user", text);
    const answerEl = bubble("assistant", "");
    answerEl.classList.add("typing");
    pending = { userEl, answerEl, message: text };
    el.input.value = "";
    setBusy(true);
  }

  // -- wiring ------------------------------------------------------------------------------------
  el.form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
  el.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  el.stop.addEventListener("click", () => {
    if (ws && pending) { ws.send(JSON.stringify({ type: "stop" })); el.stop.disabled = true; }
  });
  $("pg-new").addEventListener("click", newChat);
  el.model.addEventListener("change", modelChanged);

  drawList();
  modelChanged();
  connect();
  const want = new URLSearchParams(window.location.search).get("c");
  if (want) openConversation(parseInt(want, 10));
  el.input.focus();
})();
