// glassformer lab, shared helpers: plain JavaScript, no framework, no build step. Loaded first
// by index.html; chat.js, sampling.js, attention.js, worked.js, tokens.js and app.js use these.
// `api` is how every view calls /lab/api/* (glassformer/server/lab.py): it adds the API key,
// reads the OpenAI-style error object into one message, and shows it in the page's #error box.
"use strict";

const $ = (selector) => document.querySelector(selector);
// state.info: GET /lab/api/info's answer (app.js fetches it; chat.js sends its model name).
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

// Run `task` at most once per `wait` ms; only the newest call's answer is drawn, and only the
// newest call's error is shown (by onError).
function latest(task, wait = 40, onError = showError) {
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
        if (mine === generation) onError(error.message);
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
