// The cothink console: reads the server's event stream (/v1/events, Server-Sent Events) and draws
// one lane per coroutine, the step timeline, memory gauges, sparklines and sessions.
// The stream is read with fetch() so that the API key travels in the Authorization header (an
// EventSource cannot set headers); the key is kept in sessionStorage, never in a URL.
"use strict";

const KEY_STORAGE = "cothink.key";
const MAX_LANES = 64;
const MAX_LANE_CHARS = 20000;
const MAX_STEPS = 600;
const SPARK_POINTS = 60;

const $ = (sel) => document.querySelector(sel);

const ui = {
  connection: null, lanes: null, timeline: null, stepDetail: null, sessions: null, follow: null,
};

const state = {
  server: null,        // the server instance id from the last hello
  lastSeq: 0,          // events up to this one are already drawn (a reconnect replays history)
  lanes: new Map(),    // coroutine name -> lane record
  steps: 0,
  stepTokens: new Map(), // second -> tokens written in the steps that started in it
  ttft: [],
  gaps: [],            // recent inter-token gaps (seconds)
  lastPiece: new Map(),  // coroutine -> t of its last piece
  series: { tokens_per_s: [], ttft: [], itl_p95: [] },
  memory: null,
  abort: null,
  retryMs: 500,
};

// ---- formatting -------------------------------------------------------------------------------
function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(2)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

function fmtSeconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  return s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`;
}

function hue(name) {
  let h = 0;
  for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
  return h % 360;
}

function colorOf(name) {
  return name === "others" ? "#6b7280" : `hsl(${hue(name)}, 55%, 55%)`;
}

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text) node.textContent = text;
  return node;
}

function shortBlock(id, labels) {
  if (labels && labels[id]) return labels[id];
  return id.length > 18 ? `${id.slice(0, 12)}…` : id;
}

// ---- lanes ------------------------------------------------------------------------------------
function lane(name) {
  let rec = state.lanes.get(name);
  if (rec) return rec;
  const node = el("section", { class: "lane", "data-coroutine": name, "data-state": "waiting" });
  const head = el("div", { class: "head" });
  const title = el("span", { class: "name", title: name }, name);
  title.style.color = colorOf(name);
  const kind = el("span", { class: "badge kind" }, "");
  const st = el("span", { class: "badge state state-waiting", "data-role": "state" }, "waiting");
  const prio = el("span", { class: "badge prio" }, "");
  head.append(title, kind, st, prio);
  const blocks = el("div", { class: "blocks" }, "");
  const body = el("div", { class: "body", "data-role": "text" });
  const stats = el("div", { class: "stats" }, "");
  node.append(head, blocks, body, stats);
  ui.lanes.append(node);
  rec = { name, node, kind, st, prio, blocks, body, stats, text: null, chars: 0, tokens: 0,
    works: 0, state: "waiting", ended: false, reads: new Set(), writes: new Set(), labels: {} };
  state.lanes.set(name, rec);
  trimLanes();
  $("#lane-count").textContent = `${state.lanes.size} shown`;
  return rec;
}

function trimLanes() {
  if (state.lanes.size <= MAX_LANES) return;
  for (const [name, rec] of state.lanes) {
    if (rec.ended) {
      rec.node.remove();
      state.lanes.delete(name);
      if (state.lanes.size <= MAX_LANES) return;
    }
  }
}

function setState(rec, value) {
  rec.state = value;
  rec.node.setAttribute("data-state", value);
  rec.st.textContent = value;
  rec.st.className = `badge state state-${value}`;
  rec.ended = ["done", "cancelled", "failed", "lost"].includes(value);
}

function appendText(rec, text) {
  if (!text) return;
  if (!rec.text || rec.body.lastChild !== rec.text) {
    rec.text = document.createTextNode("");
    rec.body.append(rec.text);
  }
  rec.text.appendData(text);
  rec.chars += text.length;
  if (rec.chars > MAX_LANE_CHARS && rec.body.firstChild) {
    const first = rec.body.firstChild;
    if (first.nodeType === Node.TEXT_NODE && first.length > text.length) {
      first.deleteData(0, Math.min(first.length - 1, rec.chars - MAX_LANE_CHARS));
    } else if (first !== rec.text) {
      first.remove();
    }
    rec.chars = rec.body.textContent.length;
  }
  scrollBody(rec);
}

function appendMark(rec, attrs, text, title) {
  const mark = el("mark", attrs, text);
  if (title) mark.title = title;
  rec.body.append(mark);
  rec.text = null;
  scrollBody(rec);
  return mark;
}

function scrollBody(rec) {
  if (ui.follow.checked) rec.body.scrollTop = rec.body.scrollHeight;
}

function drawBlocks(rec) {
  const reads = [...rec.reads].filter((b) => !rec.writes.has(b)).map((b) => shortBlock(b, rec.labels));
  const writes = [...rec.writes].map((b) => shortBlock(b, rec.labels));
  rec.blocks.textContent = "";
  rec.blocks.append("reads ");
  rec.blocks.append(el("b", {}, reads.length ? reads.join(", ") : "–"));
  rec.blocks.append("  writes ");
  rec.blocks.append(el("b", {}, writes.length ? writes.join(", ") : "(scratch)"));
}

function drawStats(rec) {
  const parts = [`${rec.works} work${rec.works === 1 ? "" : "s"}`];
  if (rec.tokens) parts.push(`${rec.tokens} tokens out`);
  if (rec.ttft !== undefined) parts.push(`first token ${fmtSeconds(rec.ttft)}`);
  if (rec.outcome) parts.push(rec.outcome);
  rec.stats.textContent = parts.join(" · ");
}

// ---- events -----------------------------------------------------------------------------------
const handlers = {
  hello(d) {
    if (state.server !== null && state.server !== d.server) {
      // a new server process: what was running on the old one is gone
      for (const rec of state.lanes.values()) if (!rec.ended) setState(rec, "lost");
      const gap = el("div", { class: "step gap", title: "server restarted" });
      ui.timeline.append(gap);
      state.lastSeq = 0;
    }
    state.server = d.server;
    $("#model").textContent = `${d.model}${d.sees_all ? " · all coroutines" : " · your coroutines"}`;
  },
  coroutine(d) {
    const rec = lane(d.name);
    rec.works += 1;
    rec.outcome = "";
    rec.kind.textContent = d.kind;
    rec.node.setAttribute("data-kind", d.kind);
    rec.prio.textContent = d.priority;
    rec.node.setAttribute("data-priority", d.priority);
    Object.assign(rec.labels, d.labels || {});
    for (const b of d.view) rec.reads.add(b);
    if (d.block) rec.writes.add(d.block);
    if (d.session) rec.node.setAttribute("data-session", d.session);
    setState(rec, d.state);
    drawBlocks(rec);
    drawStats(rec);
    if (d.kind === "extend") {
      appendMark(rec, { "data-extend": d.block }, `+${d.tokens} tok → ${shortBlock(d.block, rec.labels)}`,
        `${d.name} appends ${d.tokens} tokens to ${d.block}`);
    }
  },
  state(d) {
    const rec = lane(d.name);
    if (!rec.ended) setState(rec, d.state);
    if (d.ttft_s !== undefined) {
      rec.ttft = d.ttft_s;
      state.ttft.push(d.ttft_s);
      pushSeries("ttft", d.ttft_s, fmtSeconds(d.ttft_s));
      drawStats(rec);
    }
  },
  piece(d) {
    const rec = lane(d.name);
    appendText(rec, d.text);
    rec.tokens += d.tokens;
    rec.node.dataset.tokens = String(rec.tokens);
    const last = state.lastPiece.get(d.name);
    if (last !== undefined && d.t > last) {
      state.gaps.push((d.t - last) / Math.max(1, d.tokens));
      if (state.gaps.length > 400) state.gaps.splice(0, state.gaps.length - 400);
    }
    state.lastPiece.set(d.name, d.t);
    drawStats(rec);
  },
  input(d) {
    for (const reader of d.readers) {
      const rec = lane(reader);
      appendMark(rec, { "data-input": d.block, "data-from": d.name },
        `⤵ +${d.tokens} tok → ${shortBlock(d.block, rec.labels)}`,
        `${d.name} appended ${d.tokens} tokens to ${d.block}, which this coroutine reads`);
    }
  },
  probe(d) {
    const rec = lane(d.name);
    const answer = Object.entries(d.answer).map(([c, p]) => `${JSON.stringify(c)}: ${p.toFixed(3)}`).join(", ");
    appendMark(rec, { "data-probe": d.probability.toFixed(6), "data-choice": d.top },
      `? ${JSON.stringify(d.top)} ${d.probability.toFixed(2)}`, answer);
  },
  end(d) {
    const rec = lane(d.name);
    rec.outcome = d.outcome;
    setState(rec, d.state);
    state.lastPiece.delete(d.name);
    drawStats(rec);
  },
  step(d) { addStep(d); },
  memory(d) { drawMemory(d); },
  sessions(d) { drawSessions(d.sessions); },
};

// ---- the step timeline ------------------------------------------------------------------------
function addStep(d) {
  state.steps += 1;
  const tokens = d.prefill + d.decode;
  const sec = Math.floor(d.t);
  state.stepTokens.set(sec, (state.stepTokens.get(sec) || 0) + tokens);
  const height = Math.max(3, Math.min(88, 10 + 14 * Math.log2(1 + tokens)));
  const col = el("div", { class: "step", "data-step": String(d.index) });
  col.style.height = `${height}px`;
  // width shows the step's duration: 4 px up to 5 ms, then 1 px per 5 ms, at most 28 px
  col.style.flexBasis = `${Math.max(4, Math.min(28, d.duration_ms / 5))}px`;
  const names = d.coroutines.map((c) => {
    const parts = [];
    if (c.decode) parts.push(`decode ${c.decode}`);
    if (c.prefill) parts.push(`prefill ${c.prefill}`);
    return `${c.name}: ${parts.join(", ")}`;
  });
  col.title = `step ${d.index} · ${d.duration_ms.toFixed(1)} ms · ${names.join(" · ")}`;
  col.dataset.duration = String(d.duration_ms);
  for (const c of d.coroutines) {
    for (const [kind, n] of [["decode", c.decode], ["prefill", c.prefill]]) {
      if (!n) continue;
      const seg = el("div", { class: `seg ${kind}`, "data-of": c.name });
      seg.style.flex = `${n} 0 0`;
      seg.style.background = colorOf(c.name);
      col.append(seg);
    }
  }
  col.addEventListener("mouseenter", () => { ui.stepDetail.textContent = col.title; });
  ui.timeline.append(col);
  while (ui.timeline.children.length > MAX_STEPS) ui.timeline.firstChild.remove();
  if (ui.follow.checked) ui.timeline.scrollLeft = ui.timeline.scrollWidth;
  $("#counts").textContent = `${state.steps} steps seen`;
}

// ---- gauges and sparklines --------------------------------------------------------------------
function setGauge(name, bytes, of) {
  const node = document.querySelector(`[data-gauge="${name}"]`);
  node.textContent = fmtBytes(bytes);
  node.setAttribute("data-bytes", String(bytes));
  const share = of > 0 ? Math.min(1, bytes / of) : 0;
  $(`#bar-${name}`).style.width = `${(100 * share).toFixed(1)}%`;
}

function drawMemory(m) {
  state.memory = m;
  const bound = m.budget !== null ? m.budget : m.kv_total;
  setGauge("kv", m.kv, m.kv_total);
  setGauge("linear", m.linear, bound);
  setGauge("spilled", m.spilled, bound);
  setGauge("budget", bound, bound);
  $(`#bar-budget`).style.width = `${bound > 0 ? (100 * Math.min(1, m.used / bound)).toFixed(1) : 0}%`;
  $("#budget-label").textContent = m.budget !== null ? "budget" : "budget (pool)";
  $("#memory-detail").textContent =
    `${m.used_pages}/${m.total_pages} KV pages · ${m.blocks} blocks · ${fmtBytes(m.used)} in use of ${fmtBytes(bound)}`;
}

function pushSeries(name, value, label) {
  const s = state.series[name];
  s.push(value);
  if (s.length > SPARK_POINTS) s.shift();
  document.querySelector(`[data-spark-value="${name}"]`).textContent = label;
  drawSpark(name);
}

function drawSpark(name) {
  const canvas = document.querySelector(`canvas[data-spark="${name}"]`);
  const ctx = canvas.getContext("2d");
  const s = state.series[name];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!s.length) return;
  const max = Math.max(...s) || 1;
  const w = canvas.width, h = canvas.height;
  ctx.strokeStyle = "#55a868";
  ctx.fillStyle = "rgba(85,168,104,.2)";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  s.forEach((v, i) => {
    const x = s.length === 1 ? w - 2 : (i / (SPARK_POINTS - 1)) * (w - 2) + 1;
    const y = h - 2 - (v / max) * (h - 4);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

function percentile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

let lastSecond = null;
function tickSeries() {
  // one point per second of server time: tokens written in the last whole second, inter-token p95
  if (!state.stepTokens.size) return;
  const newest = Math.max(...state.stepTokens.keys());
  if (lastSecond === null) lastSecond = newest - 1;
  while (lastSecond < newest) {
    lastSecond += 1;
    const n = state.stepTokens.get(lastSecond - 1) || 0;
    state.stepTokens.delete(lastSecond - 1);
    pushSeries("tokens_per_s", n, `${n} tok/s`);
    const p95 = percentile(state.gaps, 0.95);
    if (p95 !== null) pushSeries("itl_p95", p95, fmtSeconds(p95));
  }
}

// ---- sessions ---------------------------------------------------------------------------------
function drawSessions(sessions) {
  ui.sessions.textContent = "";
  if (!sessions.length) {
    ui.sessions.append(el("span", { class: "dim" }, "none"));
    return;
  }
  for (const s of sessions) {
    const box = el("div", { class: "session", "data-session": s.id });
    const title = el("div", {}, "");
    title.append(el("span", { class: "sid" }, s.name ? `${s.name} ` : ""),
      el("span", { class: "sid dim" }, s.id),
      el("span", { class: "dim small" }, `  ${s.block_count} blocks · ${s.running.length} running`));
    box.append(title);
    const table = el("table");
    for (const b of s.blocks) {
      const row = el("tr", { "data-block": b.id });
      const flags = el("td");
      for (const f of ["sealed", "spilled", "pinned"]) if (b[f]) flags.append(el("span", { class: "flag" }, f));
      row.append(el("td", {}, b.name || shortBlock(b.id)), el("td", {}, `${b.length} tok`), flags);
      table.append(row);
    }
    box.append(table);
    ui.sessions.append(box);
  }
}

// ---- the connection ---------------------------------------------------------------------------
function setConnection(value, text) {
  ui.connection.setAttribute("data-connection", value);
  ui.connection.textContent = text || value;
}

function dispatch(block) {
  let kind = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length || !handlers[kind]) return;
  const d = JSON.parse(data.join("\n"));
  if (kind !== "hello") {
    if (d.seq !== undefined && d.seq <= state.lastSeq) return;  // already drawn before a reconnect
    if (d.seq !== undefined) state.lastSeq = d.seq;
  }
  handlers[kind](d);
}

async function connect() {
  if (state.abort) state.abort.abort();
  const abort = new AbortController();
  state.abort = abort;
  const key = sessionStorage.getItem(KEY_STORAGE) || "";
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = `Bearer ${key}`;
  let response;
  try {
    response = await fetch("/v1/events", { headers, signal: abort.signal, cache: "no-store" });
  } catch (err) {
    if (abort.signal.aborted) return;
    return retry();
  }
  if (response.status === 401) {
    setConnection("unauthorized", key ? "key refused" : "needs an API key");
    $("#key").focus();
    return;
  }
  if (!response.ok || !response.body) return retry();
  setConnection("live");
  state.retryMs = 500;
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        dispatch(block);
      }
    }
  } catch (err) {
    if (abort.signal.aborted) return;
  }
  if (!abort.signal.aborted) retry();
}

function retry() {
  setConnection("reconnecting");
  const wait = state.retryMs;
  state.retryMs = Math.min(3000, state.retryMs * 1.5);
  setTimeout(connect, wait);
}

function reset() {
  for (const rec of state.lanes.values()) rec.node.remove();
  state.lanes.clear();
  ui.timeline.textContent = "";
  ui.sessions.textContent = "";
  state.server = null;
  state.lastSeq = 0;
  state.steps = 0;
  state.lastPiece.clear();
}

function start() {
  ui.connection = $("#connection");
  ui.lanes = $("#lanes");
  ui.timeline = $("#timeline");
  ui.stepDetail = $("#step-detail");
  ui.sessions = $("#sessions");
  ui.follow = $("#follow");
  const stored = sessionStorage.getItem(KEY_STORAGE);
  if (stored) $("#key").value = stored;
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("#key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    reset();  // another key sees other coroutines: start from its own history
    setConnection("connecting");
    connect();
  });
  setInterval(tickSeries, 1000);
  connect();
}

document.addEventListener("DOMContentLoaded", start);
