// glassformer lab: plain JavaScript, no framework, no build step. Every number on the page
// comes from the server: /v1/chat/completions for chat, /lab/api/* (glassformer/server/lab.py)
// for the rest, which call the library's own sampler, attention capture, numpy reference and
// tokenizers.
"use strict";

const $ = (selector) => document.querySelector(selector);
const state = { info: null };

// --- small helpers -----------------------------------------------------------------------------

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function showError(message) {
  const box = $("#error");
  box.textContent = message ? `error: ${message}` : "";
  box.hidden = !message;
}

// The message of a failed request: an OpenAI-style error object, FastAPI's `detail` (a string,
// or a list of validation errors that name the field), or the status line.
function errorMessage(status, payload) {
  if (payload && payload.error && payload.error.message) return payload.error.message;
  const detail = payload && payload.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail.map((d) => `${(d.loc || []).slice(1).join(".")}: ${d.msg}`).join("; ");
  }
  return `HTTP ${status}`;
}

// With `glassformer serve --api-key KEY`, every /v1 and /lab/api request carries the key the
// reader typed (kept for this tab only); a 401 shows the box to type it in.
function authHeaders() {
  const key = sessionStorage.getItem("glassformer-api-key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function askForKey(status) {
  if (status !== 401) return;
  $("#key-box").hidden = false;
  $("#api-key").focus();
}

async function api(path, body) {
  const options = body === undefined ? { headers: authHeaders() } : {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
  };
  const response = await fetch(path, options);
  const payload = await response.json().catch(() => null);
  askForKey(response.status);
  if (!response.ok) throw new Error(errorMessage(response.status, payload));
  showError("");
  return payload;
}

// Run `task` at most once per `wait` ms; only the newest call's answer is drawn.
function latest(task, wait = 40) {
  let timer = null;
  let generation = 0;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      const mine = ++generation;
      try {
        const result = await task(...args);
        if (mine === generation && result && result.draw) result.draw();
      } catch (error) {
        showError(error.message);
      }
    }, wait);
  };
}

function formatBytes(bytes) {
  if (bytes >= 2 ** 20) return `${(bytes / 2 ** 20).toFixed(2)} MiB`;
  if (bytes >= 2 ** 10) return `${(bytes / 2 ** 10).toFixed(1)} KiB`;
  return `${bytes} B`;
}

const visible = (text) => text.replace(/ /g, "␣").replace(/\n/g, "\\n");
// A piece that is only part of a character comes as its bytes in hex, "<e6 99>": shown as is.
const isBytes = (piece) => /^<[0-9a-f]{2}( [0-9a-f]{2})*>$/.test(piece);
const shownPiece = (piece) => (isBytes(piece) ? piece : visible(piece));

// --- tabs ----------------------------------------------------------------------------------

const opened = new Set();
const onOpen = {};

function openView(name) {
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const selected = tab.id === `tab-${name}`;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(`#${tab.getAttribute("aria-controls")}`).hidden = !selected;
  }
  if (!opened.has(name) && onOpen[name]) onOpen[name]();
  opened.add(name);
  history.replaceState(null, "", `#${name}`);
}

function setUpTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  tabs.forEach((tab, index) => {
    tab.addEventListener("click", () => openView(tab.id.slice(4)));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(index + step + tabs.length) % tabs.length];
      next.focus();
      openView(next.id.slice(4));
    });
  });
}

// --- 1. chat -------------------------------------------------------------------------------

const chat = { messages: [], turn: 0 };

// Read a server-sent-event stream: call onData(json) for each `data:` line until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split(/\r?\n/)) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function sendChat(event) {
  event.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text) return;
  const log = $("#chat-log");
  chat.messages.push({ role: "user", content: text });
  log.append(element("div", { class: "message user", text }));
  const reply = element("div", { class: "message assistant", "aria-busy": "true" });
  log.append(reply);
  input.value = "";
  $("#chat-send").disabled = true;
  const sentMessages = chat.messages.slice();
  const started = performance.now();
  let firstAt = null;
  let pieces = 0;
  let usage = null;
  let content = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: state.info.model.name,
        messages: sentMessages,
        stream: true,
        stream_options: { include_usage: true },
        temperature: Number($("#chat-temperature").value),
        max_tokens: Number($("#chat-max-tokens").value),
      }),
    });
    if (!response.ok) {
      const payload = await response.json().catch(() => null);
      askForKey(response.status);
      throw new Error(errorMessage(response.status, payload));
    }
    await readEvents(response, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (firstAt === null) firstAt = performance.now();
        pieces += 1;
        content += delta.content;
        reply.textContent = content;
        log.scrollTop = log.scrollHeight;
      }
    });
    const ended = performance.now();
    reply.setAttribute("aria-busy", "false");
    reply.dataset.done = "true";
    chat.messages.push({ role: "assistant", content });
    const completion = usage ? usage.completion_tokens : pieces;
    const cost = await api("/lab/api/turn_cost", {
      messages: sentMessages,
      completion_tokens: completion,
      prompt_tokens: usage ? usage.prompt_tokens : null,
    });
    chat.turn += 1;
    const ttft = firstAt === null ? null : (firstAt - started) / 1000;
    // Decode speed: the tokens after the first over the time after the first.
    const rate = firstAt !== null && completion > 1 && ended > firstAt
      ? (completion - 1) / ((ended - firstAt) / 1000) : null;
    const row = element("tr", { "data-ttft": ttft ?? "", "data-kv-bytes": cost.kv_bytes },
      element("td", { text: chat.turn }),
      element("td", { text: ttft === null ? "—" : `${(ttft * 1000).toFixed(0)} ms` }),
      element("td", { text: rate === null ? "—" : rate.toFixed(1) }),
      element("td", { text: `${cost.prompt_tokens} + ${cost.completion_tokens}` }),
      element("td", {
        text: `${formatBytes(cost.kv_bytes)} (${cost.cached_tokens} × ${cost.kv_bytes_per_token} B, ${cost.kv_dtype})`,
      }));
    $("#chat-stats tbody").append(row);
  } catch (error) {
    reply.classList.add("error");
    reply.textContent = error.message;
    reply.setAttribute("aria-busy", "false");
    chat.messages.pop();  // the turn did not happen
  } finally {
    $("#chat-send").disabled = false;
  }
}

function resetChat() {
  chat.messages = [];
  chat.turn = 0;
  $("#chat-log").replaceChildren();
  $("#chat-stats tbody").replaceChildren();
}

// --- 2. the sampling layer -----------------------------------------------------------------

const sampling = { ids: [] };

function samplingSettings() {
  const topK = Number($("#top-k").value);
  const topP = Number($("#top-p").value);
  const minP = Number($("#min-p").value);
  $("#temperature-value").textContent = Number($("#temperature").value).toFixed(2);
  $("#top-k-value").textContent = topK === 0 ? "off" : String(topK);
  $("#top-p-value").textContent = topP.toFixed(2);
  $("#min-p-value").textContent = minP.toFixed(2);
  return {
    prompt: $("#sampling-prompt").value,
    chat: $("#sampling-chat").checked,
    ids: sampling.ids,
    temperature: Number($("#temperature").value),
    top_k: topK === 0 ? null : topK,
    top_p: topP >= 1 ? null : topP,
    min_p: minP <= 0 ? null : minP,
    k: 12,
  };
}

function drawCandidates(result) {
  const summary = $("#sampling-summary");
  summary.dataset.entropy = result.entropy;
  summary.dataset.topProb = result.top_prob;
  summary.textContent = `entropy ${result.entropy.toFixed(3)} nats · top probability `
    + `${(result.top_prob * 100).toFixed(1)}% · ${result.kept.toLocaleString()} of `
    + `${result.vocab_size.toLocaleString()} tokens can be drawn`;
  const list = $("#candidates");
  list.replaceChildren(...result.candidates.map((candidate) => {
    const choose = element("button", {
      type: "button",
      title: `choose token ${candidate.id}`,
      "aria-label": `choose ${JSON.stringify(candidate.piece)}, probability ${(candidate.prob * 100).toFixed(1)}%`,
      text: shownPiece(candidate.piece),
    });
    choose.addEventListener("click", () => {
      sampling.ids = [...sampling.ids, candidate.id];
      refreshSampling();
    });
    const bar = element("div", { class: "bar", "aria-hidden": "true" },
      element("span", { class: "model", style: `width:${candidate.model_prob * 100}%` }),
      element("span", { class: "sampler", style: `width:${candidate.prob * 100}%` }));
    const item = element("li", {
      "data-id": candidate.id, "data-prob": candidate.prob, "data-model-prob": candidate.model_prob,
      class: candidate.prob === 0 ? "cut" : "",
    }, choose, bar, element("span", {
      text: `${(candidate.prob * 100).toFixed(2)}% (${(candidate.model_prob * 100).toFixed(1)}%)`,
    }));
    return item;
  }));
  $("#continuation").textContent = result.continuation;
}

const refreshSampling = latest(async () => {
  const result = await api("/lab/api/next_tokens", samplingSettings());
  return { draw: () => drawCandidates(result) };
});

async function sampleOne() {
  try {
    const drawn = await api("/lab/api/sample", samplingSettings());
    sampling.ids = [...sampling.ids, drawn.id];
    refreshSampling();
  } catch (error) {
    showError(error.message);
  }
}

// --- 3. the attention explorer ---------------------------------------------------------------

const attention = { data: null, layer: 0, head: 0, query: 0 };

function selectedMatrix() {
  const heads = attention.data.weights[attention.layer];  // (H, T, T)
  if (!$("#attention-average").checked) return heads[attention.head];
  const T = heads[0].length;
  return Array.from({ length: T }, (_, q) => Array.from({ length: T }, (_, k) =>
    heads.reduce((sum, head) => sum + head[q][k], 0) / heads.length));
}

function paint(canvas, matrix, highlightRow = null) {
  const T = matrix.length;
  canvas.width = T;
  canvas.height = T;
  const context = canvas.getContext("2d");
  const image = context.createImageData(T, T);
  for (let q = 0; q < T; q++) {
    for (let k = 0; k < T; k++) {
      const w = Math.sqrt(matrix[q][k]);  // square root: small weights stay visible
      const at = 4 * (q * T + k);
      const lit = highlightRow === q ? 1 : 0;
      image.data[at] = 255 - w * 219 - lit * 20;
      image.data[at + 1] = 255 - w * 168;
      image.data[at + 2] = 255 - w * 58 - lit * 40;
      image.data[at + 3] = 255;
    }
  }
  context.putImageData(image, 0, 0);
}

function drawGrid() {
  const { n_layers: L, n_heads: H, weights } = attention.data;
  const grid = $("#attention-grid");
  grid.style.gridTemplateColumns = `2.4em repeat(${H}, 1fr)`;
  const cells = [element("span", { class: "label" })];
  for (let h = 0; h < H; h++) cells.push(element("span", { class: "label", text: `h${h}` }));
  for (let l = 0; l < L; l++) {
    cells.push(element("span", { class: "label", text: `L${l}` }));
    for (let h = 0; h < H; h++) {
      const canvas = element("canvas", {
        role: "gridcell", tabindex: "0", "data-layer": l, "data-head": h,
        "aria-label": `layer ${l}, head ${h}`,
      });
      paint(canvas, weights[l][h]);
      const pick = () => {
        attention.layer = l;
        attention.head = h;
        drawSelection();
      };
      canvas.addEventListener("click", pick);
      canvas.addEventListener("keydown", (event) => { if (event.key === "Enter") pick(); });
      cells.push(canvas);
    }
  }
  grid.replaceChildren(...cells);
}

function drawRow() {
  const matrix = selectedMatrix();
  const row = matrix[attention.query];
  const tokens = attention.data.tokens;
  const top = Math.max(...row);
  const box = $("#attention-row");
  box.dataset.query = attention.query;
  box.replaceChildren(...row.map((weight, k) => element("span", {
    class: "key", "data-key": k, "data-weight": weight,
    style: `background: rgba(36, 87, 197, ${(0.85 * weight) / (top || 1)}); color: ${weight > 0.55 * top ? "#fff" : "inherit"}`,
  }, tokens[k], element("small", { text: weight.toFixed(3) }))));
  for (const chip of document.querySelectorAll("#attention-tokens .token")) {
    chip.classList.toggle("query", Number(chip.dataset.index) === attention.query);
  }
  paint($("#attention-matrix"), matrix, attention.query);
  const what = $("#attention-average").checked
    ? `layer ${attention.layer}, mean of ${attention.data.n_heads} heads`
    : `layer ${attention.layer}, head ${attention.head}`;
  const best = row.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 3)
    .map(([w, k]) => `${tokens[k]} ${w.toFixed(3)}`).join(", ");
  $("#attention-selected").textContent =
    `${attention.data.name} · ${what} · query “${tokens[attention.query]}” attends most to: ${best}`;
}

function drawSelection() {
  for (const cell of document.querySelectorAll("#attention-grid canvas")) {
    const sameLayer = Number(cell.dataset.layer) === attention.layer;
    const sameHead = Number(cell.dataset.head) === attention.head;
    cell.classList.toggle("selected",
      sameLayer && ($("#attention-average").checked || sameHead));
  }
  drawRow();
}

function drawAttention(data) {
  attention.data = data;
  attention.layer = Math.min(attention.layer, data.n_layers - 1);
  attention.head = Math.min(attention.head, data.n_heads - 1);
  const it = data.tokens.findIndex((t) => t.toLowerCase() === "it" || t === "它");
  attention.query = it >= 0 ? it : data.tokens.length - 1;
  $("#attention-tokens").replaceChildren(...data.tokens.map((token, index) => {
    const chip = element("button", {
      type: "button", class: "token", "data-index": index, text: token,
      "aria-label": `query token ${index}: ${token}`,
    });
    const show = () => {
      attention.query = index;
      drawRow();
    };
    chip.addEventListener("mouseenter", show);
    chip.addEventListener("focus", show);
    return chip;
  }));
  $("#attention-notes").replaceChildren(...data.notes.map((n) => element("li", { text: n })));
  drawGrid();
  drawSelection();
}

async function loadAttention(event) {
  if (event) event.preventDefault();
  try {
    const data = await api("/lab/api/attention", {
      text: $("#attention-text").value, which: $("#attention-model").value,
    });
    drawAttention(data);
  } catch (error) {
    showError(error.message);
  }
}

// --- 4. the 猫/累/它 worked example ------------------------------------------------------------

const worked = { defaults: null };

function workedInput(id, label, value) {
  return element("input", { type: "number", step: "any", id, "aria-label": label, value });
}

function buildWorkedInputs(example) {
  const d = example.q.length;
  const header = element("tr", {}, element("th", { text: "" }),
    ...Array.from({ length: d }, (_, i) => element("th", { text: `dim ${i + 1}` })));
  const rows = [header];
  rows.push(element("tr", {}, element("th", { text: `Query of ${example.query_token}` }),
    ...example.q.map((x, i) => element("td", {},
      workedInput(`worked-q-${i}`, `Query of ${example.query_token}, dimension ${i + 1}`, x)))));
  for (const [name, matrix] of [["K", example.K], ["V", example.V]]) {
    const word = name === "K" ? "Key" : "Value";
    matrix.forEach((vector, t) => {
      const token = example.tokens[t];
      rows.push(element("tr", {}, element("th", { text: `${word} of ${token}` }),
        ...vector.map((x, i) => element("td", {},
          workedInput(`worked-${name}-${t}-${i}`, `${word} of ${token}, dimension ${i + 1}`, x)))));
    });
  }
  $("#worked-inputs").replaceChildren(...rows);
}

function workedBody() {
  const example = worked.defaults;
  const read = (id) => Number($(`#${id}`).value);
  const d = example.q.length;
  const vectors = (name) => example.tokens.map((_, t) =>
    Array.from({ length: d }, (_, i) => read(`worked-${name}-${t}-${i}`)));
  return {
    q: Array.from({ length: d }, (_, i) => read(`worked-q-${i}`)),
    K: vectors("K"),
    V: vectors("V"),
    divide_by_sqrt_d: $("#worked-sqrt").checked,
    key_scale: Number($("#worked-key-scale").value),
  };
}

function drawWorked(result) {
  const tokens = worked.defaults.tokens;
  const header = element("tr", {}, element("th", { text: "key" }),
    element("th", { text: `score: q·k × ${result.scale.toFixed(3)}` }), element("th", { text: "weight" }));
  $("#worked-weights").replaceChildren(header, ...tokens.map((token, t) => {
    const weight = result.weights[t];
    return element("tr", { "data-token": token, "data-weight": weight },
      element("th", { text: token }),
      element("td", { text: result.scores[t].toFixed(3) }),
      element("td", { class: "weight" },
        element("span", { class: "bar", "aria-hidden": "true" },
          element("span", { style: `width:${weight * 100}%` })),
        weight.toFixed(3)));
  }));
  const output = $("#worked-output");
  output.dataset.values = JSON.stringify(result.output);
  output.textContent = `[${result.output.map((x) => x.toFixed(2)).join(", ")}]`;
}

const refreshWorked = latest(async () => {
  const result = await api("/lab/api/worked_example", workedBody());
  return { draw: () => drawWorked(result) };
}, 20);

async function resetWorked() {
  worked.defaults = worked.defaults || await api("/lab/api/worked_example");
  buildWorkedInputs(worked.defaults);
  $("#worked-sqrt").checked = true;
  $("#worked-key-scale").value = 1;
  refreshWorked();
}

// --- 5. the token counter ----------------------------------------------------------------------

function drawTokens(data) {
  $("#tokens-results").replaceChildren(...data.results.map((result) => {
    const box = element("div", {
      class: "vocabulary", "data-vocabulary": result.vocabulary, "data-count": result.count ?? "",
    });
    if (result.error) {
      box.append(element("h3", { text: result.vocabulary }), element("p", { text: result.error }));
      return box;
    }
    const plural = result.count === 1 ? "" : "s";
    box.append(element("h3", {
      text: `${result.vocabulary}: ${result.count} token${plural} for ${data.characters} characters`,
    }));
    box.append(element("div", { class: "pieces" }, ...result.pieces.map((piece, i) => {
      return element("span", {
        class: isBytes(piece) ? "piece partial" : "piece",
        title: `id ${result.ids[i]}`, text: shownPiece(piece),
      });
    })));
    return box;
  }));
}

const refreshTokens = latest(async () => {
  const data = await api("/lab/api/tokenize", { text: $("#tokens-text").value });
  return { draw: () => drawTokens(data) };
}, 120);

// --- start ------------------------------------------------------------------------------------

function describe(model) {
  const kv = model.kv_bytes_per_token ? ` · KV cache ${model.kv_bytes_per_token.toLocaleString()} B/token (${model.kv_dtype})` : "";
  return `${model.name} (${model.family}, ${model.n_layers} layers, ${model.n_heads} heads${kv})`;
}

async function start() {
  setUpTabs();
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-reset").addEventListener("click", resetChat);
  for (const id of ["#temperature", "#top-k", "#top-p", "#min-p", "#sampling-chat"]) {
    $(id).addEventListener("input", () => refreshSampling());
  }
  $("#sampling-prompt").addEventListener("input", () => {
    sampling.ids = [];
    refreshSampling();
  });
  $("#sample-one").addEventListener("click", sampleOne);
  $("#sampling-reset").addEventListener("click", () => {
    sampling.ids = [];
    refreshSampling();
  });
  $("#attention-form").addEventListener("submit", loadAttention);
  $("#attention-average").addEventListener("change", () => attention.data && drawSelection());
  for (const preset of document.querySelectorAll(".preset")) {
    preset.addEventListener("click", () => {
      $("#attention-text").value = preset.dataset.text;
      loadAttention();
    });
  }
  $("#worked-inputs").addEventListener("input", () => refreshWorked());
  $("#worked-sqrt").addEventListener("change", () => refreshWorked());
  $("#worked-key-scale").addEventListener("input", () => refreshWorked());
  $("#worked-times-ten").addEventListener("click", () => {
    $("#worked-key-scale").value = Number($("#worked-key-scale").value) * 10;
    refreshWorked();
  });
  $("#worked-reset").addEventListener("click", resetWorked);
  $("#tokens-text").addEventListener("input", () => refreshTokens());
  for (const preset of document.querySelectorAll(".token-preset")) {
    preset.addEventListener("click", () => {
      $("#tokens-text").value = preset.dataset.text;
      refreshTokens();
    });
  }

  $("#api-key").addEventListener("change", (event) => {
    sessionStorage.setItem("glassformer-api-key", event.target.value);
    location.reload();
  });
  try {
    state.info = await api("/lab/api/info");
  } catch (error) {
    showError(error.message);
    return;
  }
  const { model, embed_model: embed } = state.info;
  $("#loaded").textContent = [model, embed].filter(Boolean).map(describe).join(" · ");
  const choices = [embed && ["embed_model", embed.name], model && ["model", model.name]];
  $("#attention-model").replaceChildren(...choices.filter(Boolean).map(([value, name]) =>
    element("option", { value, text: name })));
  onOpen.sampling = () => refreshSampling();
  onOpen.attention = () => {
    attention.layer = (state.info.embed_model || model).n_layers - 1;
    loadAttention();
  };
  onOpen.worked = () => resetWorked();
  onOpen.tokens = () => refreshTokens();
  const first = location.hash.slice(1);
  openView($(`#tab-${first}`) ? first : "chat");
  document.body.dataset.ready = "true";
}

start();
