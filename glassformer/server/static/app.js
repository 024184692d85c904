// glassformer lab: plain JavaScript, no framework, no build step. Every number on the page
// comes from the server: /v1/chat/completions for chat, /lab/api/* (glassformer/server/lab.py)
// for the rest, which call the library's own sampler, attention capture, numpy reference and
// tokenizers. This file, loaded last, wires the tabs: GET /lab/api/info names the loaded models,
// and each view (chat.js, sampling.js, attention.js, worked.js, tokens.js, rag.js) loads the first time
// its tab opens.
"use strict";

// opened: the views already loaded; onOpen[name] loads a view the first time its tab opens (set
// once /lab/api/info has answered, since the views need the model it names).
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

function describe(model) {
  const kv = model.kv_bytes_per_token ? ` · KV cache ${model.kv_bytes_per_token.toLocaleString()} B/token (${model.kv_dtype})` : "";
  return `${model.name} (${model.family}, ${model.n_layers} layers, ${model.n_heads} heads${kv})`;
}

async function start() {
  setUpTabs();
  setUpChat();
  setUpSampling();
  setUpAttention();
  setUpWorked();
  setUpTokens();
  setUpRag();

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
  if (state.info.rag) {
    $("#tab-rag").hidden = false;
    const r = state.info.rag;
    $("#rag-store").textContent = `${r.store}: ${r.chunks.toLocaleString()} chunks of ${r.chunk_tokens} tokens (${r.embed_model})`;
  }
  const first = location.hash.slice(1);
  openView($(`#tab-${first}`) ? first : "chat");
  document.body.dataset.ready = "true";
}

start();
