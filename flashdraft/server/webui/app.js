/* flashdraft web UI: chat against /v1/chat/completions with live speed and speculative-decoding statistics.
 *
 * Conversations and settings live in localStorage. All requests use relative URLs, so the page also works
 * behind a proxy that mounts the server under a prefix. Live statistics are computed here from the stream
 * (chunks counted as tokens, time since the first content chunk) and replaced by the server's `timings` and
 * `speculative` objects when the last chunk arrives.
 */
(function () {
  "use strict";
  const $ = (sel) => document.querySelector(sel);
  const md = window.FDMarkdown;
  const esc = md.escapeHtml;
  const KEYS = { convs: "flashdraft.conversations.v1", active: "flashdraft.active.v1", settings: "flashdraft.settings.v1" };

  const state = {
    props: null,
    convs: [],         // [{id, title, created, updated, messages: [{role, content, reasoning?, status?, error?, stats?}]}]
    activeId: null,
    overrides: {},     // settings the user changed from the server defaults
    stream: null,      // {ctrl, conv, msg} while an answer streams
  };

  /* ------------------------------------------------------------------ storage */

  function load(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v ? JSON.parse(v) : fallback;
    } catch (e) {
      return fallback;
    }
  }

  function store(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {
      showNotice(`Could not save to this browser's storage (${e.message}). Delete old conversations to make room.`);
    }
  }

  let saveTimer = null;
  function saveConvs() {
    clearTimeout(saveTimer);
    saveTimer = null;
    store(KEYS.convs, state.convs);
    store(KEYS.active, state.activeId);
  }
  function saveSoon() { if (!saveTimer) saveTimer = setTimeout(saveConvs, 500); }

  function showNotice(text) {
    const el = $("#notice");
    el.textContent = text;
    el.hidden = !text;
  }

  /* ------------------------------------------------------------------ server info */

  // fetch a server path (relative, so a proxy prefix keeps working) with the API key when one is set
  function api(path, opts = {}) {
    const key = state.overrides.api_key;
    const headers = Object.assign({}, opts.headers || {}, key ? { Authorization: `Bearer ${key}` } : {});
    return fetch(path, Object.assign({ cache: "no-store" }, opts, { headers }));
  }

  const basename = (p) => String(p || "").replace(/[\\/]+$/, "").split(/[\\/]/).pop();

  function serverDefaults() {
    const props = state.props || {};
    const p = (props.default_generation_settings && props.default_generation_settings.params) || {};
    return {
      system: "", temperature: p.temperature, top_k: p.top_k, top_p: p.top_p, min_p: p.min_p,
      max_tokens: p.n_predict, reasoning: props.reasoning || "auto",
    };
  }

  function effectiveSettings() {
    return Object.assign(serverDefaults(), state.overrides);
  }

  async function loadProps() {
    try {
      const r = await api("props");
      if (r.status === 401) showNotice("The server wants an API key: set it in Settings (\u2699).");
      if (!r.ok) return;
      showNotice("");
      state.props = await r.json();
    } catch (e) {
      return;
    }
    renderHeader();
    fillSettings();
  }

  function renderHeader() {
    const p = state.props;
    if (!p) return;
    const model = p.model_alias || basename(p.model_path) || "unknown";
    $("#model-name").textContent = model;
    $("#model-name").parentElement.title = `Target model: ${p.model_path || model}`;
    const spec = p.speculative || {};
    const draft = $("#draft-name");
    if (p.draft_model_path) {
      let text = basename(p.draft_model_path);
      if (spec.type && spec.type !== "none") text += ` \u00b7 ${spec.type === "dflash" ? "DFlash" : spec.type}`;
      if (spec.block_size) text += ` block ${spec.block_size}`;
      draft.textContent = text;
      draft.parentElement.title = `Draft model: ${p.draft_model_path}` +
        (spec.draft_window ? `\nDraft context window: ${spec.draft_window}` : "");
    } else {
      draft.textContent = "no draft";
      draft.parentElement.title = "No draft model: plain decoding";
    }
    const nctx = p.default_generation_settings && p.default_generation_settings.n_ctx;
    $("#ctx-chip").hidden = !nctx;
    if (nctx) $("#ctx-size").textContent = String(nctx);
    if (p.build_info) $(".brand").title = `flashdraft ${p.build_info}`;
  }

  function setHealth(kind, text) {
    const el = $("#health");
    el.className = `health ${kind}`;
    $("#health-text").textContent = text;
  }

  let healthNotice = false;
  async function pollHealth() {
    let next = 5000;
    try {
      const r = await api("health");
      if (r.ok) {
        setHealth("ok", "ready");
        $("#health").title = "Server health: ready";
        if (healthNotice) { showNotice(""); healthNotice = false; }
        if (!state.props) await loadProps();
      } else if (r.status === 503) {
        setHealth("loading", "loading model");
        next = 2000;
      } else {
        const e = await httpError(r);
        setHealth("down", `error ${r.status}`);
        $("#health").title = e.message;
        showNotice(`The server reports a problem: ${e.message}`);
        healthNotice = true;
      }
    } catch (e) {
      setHealth("down", "server down");
      next = 3000;
    }
    setTimeout(pollHealth, next);
  }

  /* ------------------------------------------------------------------ settings */

  function fillSettings() {
    const d = serverDefaults();
    for (const el of document.querySelectorAll("#settings [data-key]")) {
      const k = el.dataset.key;
      const v = k in state.overrides ? state.overrides[k] : d[k];
      el.value = v == null ? "" : String(v);
      el.classList.toggle("changed", k in state.overrides);
    }
    const fmt = (v) => (v == null ? "?" : String(v));
    $("#settings-defaults").textContent = state.props
      ? `Server defaults: temperature ${fmt(d.temperature)}, top-k ${fmt(d.top_k)}, top-p ${fmt(d.top_p)}, ` +
        `min-p ${fmt(d.min_p)}, max tokens ${fmt(d.max_tokens)}, reasoning ${d.reasoning}.`
      : "Server defaults are not known yet (the server did not answer /props).";
  }

  function onSettingChange(ev) {
    const el = ev.target;
    const k = el.dataset && el.dataset.key;
    if (!k) return;
    const d = serverDefaults();
    let v = el.value;
    if (el.type === "number") v = v.trim() === "" ? null : Number(v);
    if (v === null || v === d[k] || (typeof v === "string" && !v.trim())) delete state.overrides[k];
    else state.overrides[k] = v;
    el.classList.toggle("changed", k in state.overrides);
    store(KEYS.settings, state.overrides);
    if (k === "api_key") loadProps();
  }

  /* ------------------------------------------------------------------ conversations */

  const uid = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  const activeConv = () => state.convs.find((c) => c.id === state.activeId) || null;

  function renderSidebar() {
    const list = $("#conv-list");
    list.textContent = "";
    const convs = state.convs.slice().sort((a, b) => b.updated - a.updated);
    for (const c of convs) {
      const li = document.createElement("li");
      li.className = "conv" + (c.id === state.activeId ? " active" : "");
      li.dataset.id = c.id;
      const title = document.createElement("span");
      title.className = "title";
      title.textContent = c.title;
      title.title = `${c.title}\n${new Date(c.updated).toLocaleString()} \u00b7 ${c.messages.length} messages`;
      const del = document.createElement("button");
      del.type = "button";
      del.className = "del";
      del.title = "Delete conversation";
      del.setAttribute("aria-label", "Delete conversation");
      del.textContent = "\u00d7";
      li.append(title, del);
      list.append(li);
    }
  }

  function selectConv(id) {
    state.activeId = id;
    store(KEYS.active, id);
    renderSidebar();
    renderMessages();
    if (window.matchMedia("(max-width: 760px)").matches) document.body.classList.remove("sidebar-open");
  }

  function deleteConv(id) {
    if (state.stream && state.stream.conv.id === id) state.stream.ctrl.abort();
    state.convs = state.convs.filter((c) => c.id !== id);
    if (state.activeId === id) state.activeId = null;
    saveConvs();
    renderSidebar();
    renderMessages();
  }

  /* ------------------------------------------------------------------ messages */

  // Split inline <think>...</think> (when the server leaves reasoning in the content) from the answer.
  function splitThinking(m) {
    let content = m.content || "";
    let reasoning = m.reasoning || "";
    const t = /^\s*<think>([\s\S]*?)(?:<\/think>\s*|$)/.exec(content);
    if (t) {
      reasoning += t[1];
      content = content.slice(t[0].length);
    }
    return { content, reasoning };
  }

  function renderMessages() {
    const box = $("#messages");
    box.textContent = "";
    const conv = activeConv();
    if (!conv || !conv.messages.length) {
      const p = state.props;
      const model = p ? p.model_alias || basename(p.model_path) : "the model";
      box.innerHTML = `<div class="welcome"><h1>Chat with ${esc(model)}</h1>` +
        "<p>Answers stream with live speed; when a draft model is loaded, each answer also shows how many " +
        "drafted tokens the target accepted.</p><p>Settings (\u2699) start from the server's defaults.</p></div>";
      return;
    }
    for (const m of conv.messages) box.append(messageEl(m));
    box.scrollTop = box.scrollHeight;
  }

  function messageEl(m) {
    const el = document.createElement("div");
    el.className = `msg ${m.role}`;
    el.msg = m;
    el.innerHTML = `<div class="role"><span>${m.role === "user" ? "you" : "assistant"}</span>` +
      `<span class="msg-actions"><button type="button" class="copy-btn" data-copy="msg" title="Copy message">Copy</button></span></div>` +
      (m.role === "assistant"
        ? '<div class="bubble"><details class="thinking" hidden><summary>Reasoning</summary><div class="content"></div></details>' +
          '<div class="content answer"></div><div class="error-box" hidden></div></div><div class="stats"></div>'
        : '<div class="bubble"></div>');
    updateMessageEl(el);
    return el;
  }

  function updateMessageEl(el) {
    const m = el.msg;
    if (m.role !== "assistant") {
      el.querySelector(".bubble").textContent = m.content;
      return;
    }
    el.classList.toggle("streaming", m.status === "streaming");
    const { content, reasoning } = splitThinking(m);
    const think = el.querySelector("details.thinking");
    think.hidden = !reasoning;
    if (reasoning) {
      think.querySelector(".content").innerHTML = md.render(reasoning);
      if (m.status === "streaming" && !content) think.open = true;
    }
    const answer = el.querySelector(".content.answer");
    if (content) {
      answer.innerHTML = md.render(content);
      if (m.status === "streaming") appendCursor(answer);
    }
    else if (m.status === "stopped") answer.innerHTML = '<span class="empty-answer">(stopped before any output)</span>';
    else if (m.status === "streaming") answer.innerHTML = reasoning ? "" : '<span class="empty-answer">\u2026</span>';
    else answer.innerHTML = m.error ? "" : '<span class="empty-answer">(empty answer)</span>';
    const err = el.querySelector(".error-box");
    err.hidden = !m.error;
    if (m.error) err.innerHTML = `<strong>${esc(m.error.title)}</strong>${esc(m.error.message)}`;
    el.querySelector(".stats").innerHTML = statsHtml(m);
  }

  // the blinking cursor goes after the last text, inside the innermost element that ends the answer
  function appendCursor(root) {
    let node = root;
    while (node.lastChild && node.lastChild.nodeType === Node.ELEMENT_NODE &&
           !/^(BR|INPUT|HR|TABLE|svg)$/i.test(node.lastChild.tagName)) node = node.lastChild;
    const cursor = document.createElement("span");
    cursor.className = "cursor";
    node.append(cursor);
  }

  /* ------------------------------------------------------------------ statistics */

  const num = (v, digits) => (v == null || !isFinite(v) ? "\u2026" : Number(v).toFixed(digits));
  const stat = (cls, html, title) => `<span class="stat ${cls}"${title ? ` title="${esc(title)}"` : ""}>${html}</span>`;

  // hist[i] = verify steps that committed i tokens (the target's own token included, so i >= 1 with a draft)
  function histSvg(hist, perPos) {
    const first = hist[0] ? 0 : 1;
    const shown = hist.slice(first);
    const max = Math.max(1, ...shown);
    const total = shown.reduce((a, b) => a + b, 0) || 1;
    const bw = 8, gap = 2, h = 20;
    const width = shown.length * (bw + gap) - gap;
    let bars = "";
    shown.forEach((c, j) => {
      const len = j + first;
      const bh = c ? Math.max(1.5, (c / max) * h) : 0;
      bars += `<rect class="bar${len <= 1 ? " zero" : ""}" x="${j * (bw + gap)}" y="${(h - bh).toFixed(1)}" ` +
        `width="${bw}" height="${bh.toFixed(1)}"><title>${len} tokens/step: ${c} steps ` +
        `(${((100 * c) / total).toFixed(0)}%)</title></rect>`;
    });
    bars += `<rect class="axis" x="0" y="${h}" width="${width}" height="0.8"></rect>` +
      `<text x="0" y="${h + 8}">${first}</text>` +
      `<text x="${width}" y="${h + 8}" text-anchor="end">${hist.length - 1}</text>`;
    const pp = perPos && perPos.length
      ? `\nAcceptance by draft position: ${perPos.map((r) => (100 * r).toFixed(0) + "%").join(" ")}` : "";
    const title = "Acceptance lengths: verify steps by tokens committed per step" + pp;
    return `<span class="hist stat-hist" title="${esc(title)}"><span>tokens/step</span>` +
      `<svg width="${width}" height="${h + 9}" viewBox="0 0 ${width} ${h + 9}" role="img" ` +
      `aria-label="acceptance length histogram">${bars}</svg></span>`;
  }

  function statsHtml(m) {
    const st = m.stats;
    if (!st) return "";
    const out = [];
    const streaming = m.status === "streaming";
    // While streaming, `timings` can only be running totals (timings_per_token); final ones come last.
    const t = st.timings;
    const spec = st.speculative;
    const drafting = !!(spec || (t && t.draft_n) || (streaming && state.props && state.props.draft_model_path));
    if (streaming) out.push('<span class="badge live">live</span>');
    if (m.status === "stopped") out.push('<span class="badge stopped">stopped</span>');
    if (m.status === "interrupted") out.push('<span class="badge stopped">interrupted</span>');
    if (t && !(streaming && !t.predicted_n)) {
      out.push(stat("stat-tps", `<b>${num(t.predicted_per_second, 1)}</b> tok/s`,
        `${t.predicted_n} tokens in ${num(t.predicted_ms, 0)} ms (${num(t.predicted_per_token_ms, 2)} ms/token)`));
      out.push(stat("stat-prompt", `prompt <b>${t.prompt_n}</b> tok \u00b7 <b>${num(t.prompt_per_second, 1)}</b> tok/s` +
        (t.cache_n ? ` \u00b7 ${t.cache_n} cached` : ""), `prompt processed in ${num(t.prompt_ms, 1)} ms`));
      out.push(stat("stat-completion", `<b>${t.predicted_n}</b> tokens`));
    } else if (st.live && (streaming || st.live.n)) {
      // measured here: chunks counted as tokens, rate since the first content chunk
      const L = st.live;
      const tps = L.n > 1 && L.gen_ms > 0 ? ((L.n - 1) * 1000) / L.gen_ms : null;
      const unit = drafting ? "chunks (one per verify step)" : "chunks";
      const ttft = L.ttft_ms != null ? `first token after <b>${num(L.ttft_ms, 0)}</b> ms` : "";
      out.push(stat("stat-tps", `<b>${num(tps, 1)}</b> tok/s`, `measured in the browser from streamed ${unit}`));
      if (streaming) {
        out.push(stat("stat-prompt", "prompt <b>\u2026</b> tok" + (ttft ? ` \u00b7 ${ttft}` : ""),
          "prompt statistics arrive with the last chunk"));
      } else if (ttft) {
        out.push(stat("stat-prompt", ttft, "the answer ended early: the server's statistics never came"));
      }
      out.push(stat("stat-completion", `<b>${L.n}</b> tokens`, `counted from streamed ${unit}`));
    }
    if (drafting && (t || spec || streaming)) {
      const rate = spec && spec.acceptance_rate != null ? spec.acceptance_rate
        : t && t.draft_n ? t.draft_n_accepted / t.draft_n : null;
      const counts = t && t.draft_n ? ` (${t.draft_n_accepted}/${t.draft_n})`
        : spec ? ` (${spec.draft_n_accepted}/${spec.draft_n})` : "";
      out.push(stat("stat-accept-len", `accept len <b>${num(spec && spec.mean_acceptance_length, 2)}</b>`,
        "mean acceptance length: tokens committed per target verify step, the target's own token included" +
        (spec && spec.verify_steps ? ` (${spec.verify_steps} steps)` : "")));
      out.push(stat("stat-accept-rate", `accepted <b>${rate == null ? "\u2026" : num(100 * rate, 1) + "%"}</b>`,
        "drafted tokens the target accepted" + counts));
      if (spec && spec.acceptance_histogram && spec.acceptance_histogram.length) {
        out.push(histSvg(spec.acceptance_histogram, spec.per_position_acceptance));
      }
    } else if (t && !streaming) {
      out.push(stat("stat-nodraft", "no drafting"));
    }
    if (st.finish === "length") out.push('<span class="badge" title="finish_reason: length">max tokens reached</span>');
    return out.join("");
  }

  /* ------------------------------------------------------------------ sending and streaming */

  const stripThink = (s) => String(s || "").replace(/^\s*<think>[\s\S]*?<\/think>\s*/, "");

  function requestBody(conv, pending) {
    const s = effectiveSettings();
    const messages = [];
    if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
    for (const m of conv.messages) {
      if (m === pending) continue;
      const content = m.role === "assistant" ? stripThink(m.content) : m.content;
      if (m.role === "assistant" && !content) continue; // failed or empty answers are not history
      messages.push({ role: m.role, content });
    }
    // timings_per_token: llama-server then puts running `timings` on every chunk (exact live token counts)
    const body = { messages, stream: true, stream_options: { include_usage: true }, timings_per_token: true };
    for (const k of ["temperature", "top_k", "top_p", "min_p"]) if (s[k] != null) body[k] = s[k];
    if (s.max_tokens != null && s.max_tokens !== -1) body.max_tokens = s.max_tokens;
    if (s.reasoning === "on" || s.reasoning === "off") body.chat_template_kwargs = { enable_thinking: s.reasoning === "on" };
    return body;
  }

  async function httpError(res) {
    const text = await res.text().catch(() => "");
    let message = text || res.statusText;
    let type = "";
    try {
      const j = JSON.parse(text);
      const e = j.error !== undefined ? j.error : j;
      if (typeof e === "string") message = e;
      else if (e && e.message) { message = e.message; type = e.type || ""; }
      else if (j.detail) message = typeof j.detail === "string" ? j.detail
        : j.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("\n");
    } catch (e) { /* not JSON: keep the text */ }
    let hint = "";
    if (type === "exceed_context_size_error") hint = "\nStart a new conversation or send a shorter message.";
    if (res.status === 401) hint = "\nSet the server's API key in Settings (\u2699).";
    if (res.status === 503) hint = "\nThe server is not ready yet (still loading the model?). Try again in a moment.";
    return { title: `Server error ${res.status}${type ? ` \u00b7 ${type}` : ""}`, message: message + hint };
  }

  // Parse one SSE event block into the message; returns true on [DONE].
  function handleEvent(block, msg, live) {
    const data = block.split(/\r\n|\n|\r/).filter((l) => l.startsWith("data:")).map((l) => l.slice(l[5] === " " ? 6 : 5)).join("\n");
    if (!data) return false; // comment / keep-alive ping
    if (data.trim() === "[DONE]") return true;
    let obj;
    try {
      obj = JSON.parse(data);
    } catch (e) {
      return false;
    }
    if (obj.error) {
      const e = obj.error;
      throw { title: `Server error${e.type ? ` \u00b7 ${e.type}` : ""}`, message: e.message || JSON.stringify(e) };
    }
    for (const ch of obj.choices || []) {
      const d = ch.delta || {};
      const piece = (d.content || "") + (d.reasoning_content || "");
      if (d.content) msg.content += d.content;
      if (d.reasoning_content) msg.reasoning = (msg.reasoning || "") + d.reasoning_content;
      if (piece) {
        const now = performance.now();
        if (live.tFirst == null) {
          live.tFirst = now;
          msg.stats.live.ttft_ms = now - live.t0;
        }
        msg.stats.live.n += 1;
        msg.stats.live.gen_ms = now - live.tFirst;
      }
      if (ch.finish_reason) msg.stats.finish = ch.finish_reason;
    }
    if (obj.timings) msg.stats.timings = obj.timings;
    if (obj.speculative) msg.stats.speculative = obj.speculative;
    if (obj.usage) msg.stats.usage = obj.usage;
    return false;
  }

  let renderQueued = false;
  function scheduleRender() {
    if (renderQueued) return;
    renderQueued = true;
    requestAnimationFrame(() => {
      renderQueued = false;
      renderStreaming();
    });
  }

  function renderStreaming() {
    if (state.stream) refreshMessage(state.stream.conv, state.stream.msg);
  }

  // re-render one message of the shown conversation, following the bottom if the reader is there
  function refreshMessage(conv, msg) {
    if (conv.id !== state.activeId) return;
    const box = $("#messages");
    const el = Array.from(box.children).find((c) => c.msg === msg);
    if (!el) return;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    updateMessageEl(el);
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function setStreaming(on) {
    $("#send").hidden = on;
    $("#stop").hidden = !on;
  }

  async function send(text) {
    if (state.stream) return;
    let conv = activeConv();
    if (!conv) {
      conv = { id: uid(), title: "New chat", created: Date.now(), updated: Date.now(), messages: [] };
      state.convs.push(conv);
      state.activeId = conv.id;
    }
    if (!conv.messages.length) conv.title = text.split("\n")[0].slice(0, 60) || "New chat";
    conv.messages.push({ role: "user", content: text });
    const msg = { role: "assistant", content: "", status: "streaming", stats: { live: { n: 0, ttft_ms: null, gen_ms: 0 } } };
    const body = requestBody(conv, msg);
    conv.messages.push(msg);
    conv.updated = Date.now();
    const ctrl = new AbortController();
    state.stream = { ctrl, conv, msg };
    saveConvs();
    renderSidebar();
    renderMessages();
    setStreaming(true);
    const live = { t0: performance.now(), tFirst: null };
    let reading = false;
    try {
      const res = await api("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal: ctrl.signal,
      });
      if (!res.ok) throw await httpError(res);
      reading = true;
      const reader = res.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      let done = false;
      while (!done) {
        const r = await reader.read();
        if (r.done) break;
        buf += dec.decode(r.value, { stream: true });
        let sep;
        while (!done && (sep = /\r\n\r\n|\n\n|\r\r/.exec(buf))) { // events end with a blank line
          const block = buf.slice(0, sep.index);
          buf = buf.slice(sep.index + sep[0].length);
          done = handleEvent(block, msg, live);
        }
        saveSoon();
        scheduleRender();
      }
      if (!done && buf.trim()) handleEvent(buf, msg, live);
      msg.status = "done";
    } catch (e) {
      if (e && e.name === "AbortError") {
        msg.status = "stopped";
      } else {
        msg.status = "error";
        msg.error = e && e.title ? e
          : reading ? { title: "Connection lost", message: `The stream from the server broke off (${e && e.message}).` }
          : { title: "Server unreachable", message: `Could not reach the server at ${location.origin} (${e && e.message}). Is \`flashdraft serve\` running?` };
        if (!e || !e.title) setHealth("down", "server down");
      }
    } finally {
      state.stream = null;
      conv.updated = Date.now();
      saveConvs();
      setStreaming(false);
      refreshMessage(conv, msg);
      renderSidebar();
    }
  }

  function stop() {
    if (state.stream) state.stream.ctrl.abort();
  }

  /* ------------------------------------------------------------------ clipboard */

  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        return true;
      } catch (e) { /* fall back below */ }
    }
    const ta = document.createElement("textarea");
    ta.value = text;
    ta.style.position = "fixed";
    ta.style.opacity = "0";
    document.body.append(ta);
    ta.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    ta.remove();
    return ok;
  }

  async function onCopy(btn) {
    let text = "";
    if (btn.dataset.copy === "code") text = btn.closest(".codeblock").querySelector("pre code").textContent;
    else text = (btn.closest(".msg").msg || {}).content || "";
    const ok = await copyText(text);
    btn.textContent = ok ? "Copied" : "Copy failed";
    btn.classList.toggle("done", ok);
    btn.dataset.copied = text;
    setTimeout(() => { btn.textContent = "Copy"; btn.classList.remove("done"); }, 1500);
  }

  /* ------------------------------------------------------------------ wiring */

  function init() {
    state.convs = load(KEYS.convs, []);
    state.activeId = load(KEYS.active, null);
    state.overrides = load(KEYS.settings, {});
    for (const c of state.convs) {
      for (const m of c.messages) if (m.status === "streaming") m.status = "interrupted"; // page closed mid-answer
    }
    if (!activeConv()) state.activeId = null;

    const input = $("#input");
    const grow = () => { input.style.height = "auto"; input.style.height = input.scrollHeight + "px"; };
    $("#composer").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const text = input.value;
      if (!text.trim() || state.stream) return;
      input.value = "";
      grow();
      send(text);
    });
    input.addEventListener("input", grow);
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        $("#composer").requestSubmit();
      }
    });
    document.addEventListener("keydown", (ev) => { if (ev.key === "Escape") stop(); });
    $("#stop").addEventListener("click", stop);
    $("#new-chat").addEventListener("click", () => { selectConv(null); input.focus(); });
    $("#conv-list").addEventListener("click", (ev) => {
      const li = ev.target.closest(".conv");
      if (!li) return;
      if (ev.target.closest(".del")) deleteConv(li.dataset.id);
      else selectConv(li.dataset.id);
    });
    $("#messages").addEventListener("click", (ev) => {
      const btn = ev.target.closest(".copy-btn");
      if (btn) onCopy(btn);
    });
    $("#toggle-sidebar").addEventListener("click", () => {
      const narrow = window.matchMedia("(max-width: 760px)").matches;
      document.body.classList.toggle(narrow ? "sidebar-open" : "sidebar-hidden");
    });
    const settings = $("#settings");
    $("#open-settings").addEventListener("click", () => { settings.hidden = !settings.hidden; });
    $("#close-settings").addEventListener("click", () => { settings.hidden = true; });
    settings.addEventListener("input", onSettingChange);
    settings.addEventListener("change", onSettingChange);
    $("#reset-settings").addEventListener("click", () => {
      state.overrides = state.overrides.api_key ? { api_key: state.overrides.api_key } : {};
      store(KEYS.settings, state.overrides);
      fillSettings();
    });

    renderSidebar();
    renderMessages();
    fillSettings();
    loadProps();
    pollHealth();
    input.focus();
  }

  init();
})();
