// The web console: a live view of the pool and a chat playground, over one WebSocket.
import { OrchardClient } from "./orchard.js";

/** @param {string} selector @returns {any} */
const $ = (selector) => document.querySelector(selector);

const KEY_STORAGE = "orchard.apiKey";
const client = new OrchardClient(undefined, {
  apiKey: localStorage.getItem(KEY_STORAGE) ?? undefined,
  onStatus: showConnection,
});

// --- connection --------------------------------------------------------------------------

/** @param {import("./orchard.js").ConnectionStatus} status */
function showConnection(status) {
  const el = $("#connection");
  el.dataset.status = status;
  el.textContent = {
    open: "connected",
    connecting: "connecting…",
    refused: `refused: ${client?.refusal?.message ?? ""}`,
    closed: "closed",
  }[status];
  $("#pool").classList.toggle("stale", status !== "open");
  // The gateway wants an API key (or a different one): ask for it.
  $("#auth").hidden = !(status === "refused" && client?.refusal?.error.code === "invalid_api_key");
  if (status === "open") measureLatency();
}

$("#auth").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("#api-key").value.trim();
  localStorage.setItem(KEY_STORAGE, key);
  client.setApiKey(key);
});

async function measureLatency() {
  try {
    const ms = await client.ping();
    $("#latency").textContent = `${ms.toFixed(1)} ms`;
  } catch {
    $("#latency").textContent = "";
  }
}
setInterval(() => client.status === "open" && measureLatency(), 5000);

// --- pool view ---------------------------------------------------------------------------

const integer = new Intl.NumberFormat("en-US");
const oneDecimal = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });

/** @param {number} bytes */
function megabytes(bytes) {
  return `${oneDecimal.format(bytes / 2 ** 20)} MiB`;
}

/** @param {number} bytes */
function gib(bytes) {
  return `${Math.round(bytes / 2 ** 30)} GiB`;
}

/** @param {number} bytes as people read it: 512 KiB, 3.2 MiB, 1.5 GiB */
function humanBytes(bytes) {
  const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit === 0 ? `${value} bytes` : `${oneDecimal.format(value)} ${units[unit]}`;
}

/** @param {number} since unix seconds */
function uptime(since) {
  let s = Math.max(0, Math.floor(Date.now() / 1000 - since));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  s %= 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  return m ? `${m}m ${s}s` : `${s}s`;
}

/**
 * @param {string} tag @param {Record<string, string>} attrs @param {(Node | string)[]} children
 * @returns {HTMLElement}
 */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  node.append(...children);
  return node;
}

/** The hardware cell's tooltip: platform, CPUs and, on a GPU, what MLX says of it.
 * @param {Record<string, any>} hw */
function hardwareTitle(hw) {
  const parts = [hw.platform, `${hw.cpu_count} CPUs`];
  if (hw.accelerator) parts.push(hw.accelerator);
  if (hw.accelerator_memory_bytes) parts.push(`GPU memory ${gib(hw.accelerator_memory_bytes)}`);
  if (hw.accelerator_limit_bytes) parts.push(`MLX working-set limit ${gib(hw.accelerator_limit_bytes)}`);
  return parts.join(", ");
}

/** The hardware cell's tooltip; for a runner group (one model split across machines), a
 * line per member, rank 0 first.
 * @param {Record<string, any>} runner */
function groupTitle(runner) {
  const members = runner.members || [];
  if (members.length < 2) return hardwareTitle(runner.hardware);
  return members.map((m, rank) =>
    `rank ${rank}: ${m.chip}, ${gib(m.memory_bytes)}, ${m.backend}; ${hardwareTitle(m)}`).join("\n");
}

/**
 * One of a runner's models: loaded (its name), loading (with the download's progress) or
 * loadable on demand (muted; the last load's error in red, and in its title).
 * @param {Record<string, any>} m
 */
function modelChip(m) {
  const facts = [];
  if (m.context_length) facts.push(`context ${integer.format(m.context_length)}`);
  if (m.size_bytes) facts.push(`${megabytes(m.size_bytes)} of weights`);
  // The runner's options for it: its sampling defaults, draft model, KV bits, adapter.
  const defaults = Object.entries(m.defaults || {}).map(([k, v]) => `${k} ${v}`);
  if (defaults.length) facts.push(`defaults: ${defaults.join(", ")}`);
  if (m.draft_model) facts.push(`draft model ${m.draft_model}`);
  if (m.kv_bits) facts.push(`${m.kv_bits}-bit KV cache`);
  if (m.adapter) facts.push(`adapter ${m.adapter}`);
  let label = m.id;
  if (m.state === "loading") {
    const d = m.download;
    label += d && d.total_bytes ? ` · ${Math.floor((100 * d.done_bytes) / d.total_bytes)} %` : " · loading";
    if (d) facts.push(`downloading: ${integer.format(d.done_bytes)} of ${integer.format(d.total_bytes)} bytes`);
  } else if (m.state === "loadable") {
    facts.push(m.error ? `its last load failed: ${m.error}` : "loaded when a request asks for it");
  }
  const failed = m.state === "loadable" && m.error ? " failed" : "";
  return el("span", {
    class: `chip ${m.state}${failed}`, "data-model": m.id, "data-state": m.state, title: facts.join("; "),
  }, label);
}

/**
 * A runner's KV caches: what they hold in memory (of it, the kept prompts) and on disk; the
 * title says what each figure is and the prefixes of conversations held.
 * @param {Record<string, any> | undefined} kv
 */
function kvCell(kv) {
  if (!kv || kv.bytes == null) return el("td", { "data-col": "kv-cache", class: "num" }, "–");
  const parts = [humanBytes(kv.bytes)];
  const facts = [`${integer.format(kv.bytes)} bytes of KV cache in memory`
    + (kv.limit_bytes ? ` (budget ${integer.format(kv.limit_bytes)})` : "")];
  if (kv.prefix_bytes != null) {
    parts.push(`kept ${humanBytes(kv.prefix_bytes)}`);
    facts.push(`${integer.format(kv.prefix_bytes)} of them kept prompts`);
  }
  if (kv.disk_bytes != null) {
    parts.push(`disk ${humanBytes(kv.disk_bytes)}`);
    facts.push(`${integer.format(kv.disk_bytes)} bytes on disk`
      + (kv.disk_limit_bytes ? ` (of ${integer.format(kv.disk_limit_bytes)})` : ""));
  }
  if (kv.prefixes != null) facts.push(`${integer.format(kv.prefixes)} conversation prefixes held`);
  return el("td", { "data-col": "kv-cache", class: "num", title: facts.join("; ") }, parts.join(" · "));
}

/** @param {Record<string, any>} runner */
function runnerRow(runner) {
  const hw = runner.hardware;
  const members = runner.members || [];
  const load = runner.max_concurrent ? runner.active / runner.max_concurrent : 0;
  const bar = el("span", { class: "bar" }, el("span", { style: `width:${Math.round(load * 100)}%` }));
  return el("tr", { "data-runner-name": runner.name, "data-runner-id": runner.id },
    el("td", { "data-col": "name" }, el("strong", {}, runner.name),
      runner.draining ? el("span", { class: "tag", "data-testid": "draining" }, "draining") : "",
      el("small", {}, runner.id)),
    el("td", { "data-col": "hardware", title: groupTitle(runner) },
      `${hw.chip} · ${gib(hw.memory_bytes)} · ${hw.backend}`
        + (hw.gpu_cores ? ` · ${hw.gpu_cores} GPU cores` : "")
        + (members.length > 1 ? ` · group of ${members.length}` : "")),
    el("td", { "data-col": "models" }, ...runner.models.map(modelChip)),
    el("td", { "data-col": "active", class: "num" }, bar, `${runner.active} / ${runner.max_concurrent}`),
    el("td", { "data-col": "requests-served", class: "num" }, integer.format(runner.requests_served)),
    el("td", { "data-col": "tokens-generated", class: "num" }, integer.format(runner.tokens_generated)),
    el("td", { "data-col": "tokens-per-second", class: "num" }, oneDecimal.format(runner.tokens_per_second)),
    kvCell(runner.kv_cache),
    el("td", { "data-col": "uptime", class: "num" }, uptime(runner.connected_since)),
  );
}

/** @param {import("./orchard.js").PoolState} state */
function renderPool(state) {
  $("#runner-count").textContent = state.runners.length;
  $("#in-flight").textContent = state.requests_in_flight;
  $("#queue-depth").textContent = state.queue_depth;
  const total = state.runners.reduce((sum, r) => sum + r.tokens_per_second, 0);
  $("#pool-tps").textContent = oneDecimal.format(total);
  $("#runners tbody").replaceChildren(...state.runners.map(runnerRow));
  $("#no-runners").hidden = state.runners.length > 0;
  renderModels(state.models);
  if (state.history) {
    lastHistory = state.history;
    renderTrends();
  }
}

// --- the last minutes: line charts from pool.state's history ------------------------------

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6f4f", "#3b5bdb", "#c2410c", "#7c3aed", "#0e7490", "#a16207", "#be185d"];
/** @type {Record<string, any> | null} */
let lastHistory = null;

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

/** A line chart of series sharing one x axis (buckets, oldest first); null values are gaps.
 * @param {SVGSVGElement} svg
 * @param {{key: string, color: string, dashed?: boolean, values: (number|null)[]}[]} lines */
function drawChart(svg, lines) {
  const width = 600, height = 160, pad = 24;
  const values = lines.flatMap((l) => l.values.filter((v) => v !== null));
  const top = Math.max(1, ...values) * 1.1;
  const n = Math.max(1, ...lines.map((l) => l.values.length)) - 1 || 1;
  const x = (i) => pad + (i / n) * (width - 2 * pad);
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  const nodes = [
    svgEl("line", { x1: pad, y1: height - pad, x2: width - pad, y2: height - pad, class: "axis" }),
    Object.assign(svgEl("text", { x: pad, y: 12, class: "tick" }), { textContent: integer.format(Math.round(top)) }),
    Object.assign(svgEl("text", { x: width - pad, y: height - 6, class: "tick", "text-anchor": "end" }), { textContent: "now" }),
  ];
  for (const line of lines) {
    let run = [];
    const runs = [];
    line.values.forEach((v, i) => {
      if (v === null) { if (run.length) runs.push(run); run = []; } else run.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
    });
    if (run.length) runs.push(run);
    const last = [...line.values].reverse().find((v) => v !== null);
    for (const points of runs) {
      if (points.length === 1) { // a lone bucket between gaps: a dot, or it would not show
        const [cx, cy] = points[0].split(",");
        nodes.push(svgEl("circle", { cx, cy, r: 3, fill: line.color, "data-series": line.key }));
      }
      nodes.push(svgEl("polyline", {
        points: points.join(" "), fill: "none", stroke: line.color, "stroke-width": 2,
        ...(line.dashed ? { "stroke-dasharray": "5 4" } : {}),
        "data-series": line.key, "data-last": last ?? "",
      }));
    }
  }
  svg.replaceChildren(...nodes);
}

function renderTrends() {
  const history = lastHistory;
  if (!history) return;
  const by = /** @type {HTMLInputElement} */ (document.querySelector('input[name="trend-by"]:checked')).value;
  const groups = history[by] || {};
  const names = Object.keys(groups);
  const color = (i) => COLORS[i % COLORS.length];
  drawChart($("#chart-tps"), names.map((name, i) => ({
    key: `${name}:tokens_per_second`, color: color(i), values: groups[name].tokens_per_second })));
  drawChart($("#chart-ttft"), names.flatMap((name, i) => [
    { key: `${name}:ttft_p50_ms`, color: color(i), values: groups[name].ttft_p50_ms },
    { key: `${name}:ttft_p99_ms`, color: color(i), dashed: true, values: groups[name].ttft_p99_ms },
  ]));
  $("#trend-legend").replaceChildren(...names.map((name, i) => {
    const series = groups[name];
    const lastOf = (values) => [...values].reverse().find((v) => v !== null);
    const p50 = lastOf(series.ttft_p50_ms), p99 = lastOf(series.ttft_p99_ms);
    const rate = series.tokens_per_second[series.tokens_per_second.length - 1];
    return el("li", { "data-name": name, style: `--swatch:${color(i)}` }, el("strong", {}, name),
      ` ${oneDecimal.format(rate)} tok/s · TTFT p50 ${p50 ?? "–"} ms, p99 ${p99 ?? "–"} ms`);
  }));
}

for (const input of document.querySelectorAll('input[name="trend-by"]')) {
  input.addEventListener("change", renderTrends);
}

/** Rebuild the picker only when the list changes, keeping the choice. @param {string[]} models */
function renderModels(models) {
  const select = $("#model");
  const current = [...select.options].map((o) => o.value).filter(Boolean);
  if (current.join("\n") === models.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => el("option", { value: m }, m)));
  if (!models.length) select.append(el("option", { value: "", disabled: "" }, "no models"));
  if (models.includes(chosen)) select.value = chosen;
  updateButtons();
}

client.subscribePool(renderPool);

// --- playground ----------------------------------------------------------------------------

/** The conversation so far, as sent to the model. @type {{role: string, content: string}[]} */
let history = [];
/** The request streaming now, if any. @type {import("./orchard.js").Completion | null} */
let inFlight = null;

const conversation = $("#conversation");

function updateButtons() {
  $("#send").disabled = inFlight !== null || !$("#model").value;
  $("#stop").disabled = inFlight === null;
}

/** Scroll along only when the reader is already at the bottom. @param {() => void} change */
function keepScrolled(change) {
  const atBottom = conversation.scrollHeight - conversation.scrollTop - conversation.clientHeight < 40;
  change();
  if (atBottom) conversation.scrollTop = conversation.scrollHeight;
}

/** @param {string} text */
function addUserMessage(text) {
  const node = el("article", { class: "message user", "data-testid": "user-message" },
    el("div", { class: "role" }, "you"), el("div", { class: "content" }, text));
  keepScrolled(() => conversation.append(node));
  return node;
}

function addAssistantMessage() {
  const node = $("#assistant-template").content.firstElementChild.cloneNode(true);
  node.classList.add("streaming");
  keepScrolled(() => conversation.append(node));
  return node;
}

/**
 * @param {HTMLElement} node
 * @param {import("./orchard.js").Done} done
 * @param {number | null} seconds first token to done
 */
function showUsage(node, { finishReason, usage }, seconds) {
  const rate = seconds && seconds > 0 ? oneDecimal.format(usage.completion_tokens / seconds) : "n/a";
  const line = node.querySelector(".usage");
  const field = (name, label, value) =>
    el("span", { "data-field": name }, `${label} `, el("b", {}, String(value)));
  line.replaceChildren(
    field("prompt", "prompt", usage.prompt_tokens),
    field("completion", "completion", usage.completion_tokens),
    field("cached", "cached", usage.prompt_tokens_details?.cached_tokens ?? 0),
    field("reasoning", "reasoning", usage.completion_tokens_details?.reasoning_tokens ?? 0),
    field("rate", "tok/s", rate),
    field("finish", "finish", finishReason),
  );
  line.hidden = false;
  node.dataset.finish = finishReason;
  if (finishReason === "cancelled") {
    node.classList.add("stopped");
    node.querySelector(".badge").textContent = "stopped";
  }
}

async function send() {
  const text = $("#prompt").value.trim();
  const model = $("#model").value;
  if (!text || !model || inFlight) return;
  $("#prompt").value = "";
  conversation.querySelector(".hint")?.remove();
  const turns = history; // "New chat" mid-stream starts a new array; this turn stays in its own
  turns.push({ role: "user", content: text });
  const userNode = addUserMessage(text);
  const node = addAssistantMessage();
  const answer = node.querySelector(".answer").appendChild(document.createTextNode(""));
  const reasoning = node.querySelector(".reasoning").appendChild(document.createTextNode(""));

  /** @type {Record<string, any>} */
  const body = { model, messages: turns.slice() };
  const maxTokens = parseInt($("#max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const temperature = parseFloat($("#temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;

  const completion = client.create(body);
  inFlight = completion;
  updateButtons();
  let firstTokenAt = null;
  try {
    for await (const chunk of completion) {
      const delta = chunk.choices[0]?.delta ?? {};
      if (!delta.content && !delta.reasoning_content) continue;
      firstTokenAt ??= performance.now();
      keepScrolled(() => {
        if (delta.reasoning_content) {
          reasoning.appendData(delta.reasoning_content);
          reasoning.parentElement.hidden = false;
        }
        if (delta.content) answer.appendData(delta.content);
      });
    }
    const done = await completion.usage;
    const seconds = firstTokenAt === null ? null : (performance.now() - firstTokenAt) / 1000;
    showUsage(node, done, seconds);
    if (answer.data) turns.push({ role: "assistant", content: answer.data });
    else dropTurn(turns, userNode, node); // nothing to continue from
  } catch (err) {
    node.classList.add("failed");
    node.querySelector(".badge").textContent = "error";
    node.append(el("div", { class: "error", "data-testid": "error" },
      err.error?.message ?? String(err)));
    dropTurn(turns, userNode, node);
  } finally {
    node.classList.remove("streaming");
    inFlight = null;
    updateButtons();
  }
}

/**
 * Take a turn that produced no answer out of the history (it stays on screen, faded).
 * @param {{role: string, content: string}[]} turns @param {HTMLElement} userNode @param {HTMLElement} node
 */
function dropTurn(turns, userNode, node) {
  turns.pop();
  userNode.classList.add("dropped");
  node.classList.add("dropped");
  node.title = userNode.title = "Not part of the conversation sent to the model";
}

$("#composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("#prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("#stop").addEventListener("click", () => inFlight?.cancel());
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") inFlight?.cancel();
});
$("#new-chat").addEventListener("click", () => {
  inFlight?.cancel();
  history = [];
  conversation.replaceChildren();
  $("#prompt").focus();
});
$("#model").addEventListener("change", updateButtons);
updateButtons();

/** Over HTTPS, the certificate's fingerprint from /health, to compare with the gateway's log
 * (and to trust the same certificate elsewhere: docs/security.md). */
async function showTls() {
  if (location.protocol !== "https:") return;
  try {
    const health = await (await fetch("/health")).json();
    if (!health.tls_fingerprint) return;
    const node = $("#tls");
    node.textContent = `TLS ${health.tls_fingerprint.slice(0, 11)}…`;
    node.title = `certificate SHA-256 fingerprint ${health.tls_fingerprint}`;
    node.dataset.fingerprint = health.tls_fingerprint;
    node.hidden = false;
  } catch {
    // no fingerprint shown; the console works without it
  }
}
showTls();
