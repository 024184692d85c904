// glassformer lab, view 6: retrieve, then generate (serve --rag-store). POST /lab/api/rag finds
// the chunks for a question and returns two conversations: one with the numbered sources, one
// stuffed with the store's text in document order. Both are streamed from
// /v1/chat/completions like any chat, one after the other, and each shows its prompt tokens
// (the server's usage), time to first token (retrieval included for RAG) and the answer.
// Needs common.js and chat.js (readEvents).
"use strict";

async function streamAnswer(messages, show) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify({
      model: state.info.model.name, messages, stream: true, temperature: 0,
      max_tokens: Number($("#rag-max-tokens").value),
      stream_options: { include_usage: true },
    }),
  });
  if (!response.ok) {
    const payload = await response.json().catch(() => null);
    askForKey(response.status);
    throw new Error(errorMessage(response.status, payload));
  }
  const started = performance.now();
  const answer = { text: "", firstMs: null, usage: null };
  await readEvents(response, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) answer.usage = chunk.usage;
    const piece = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
    if (!piece) return;
    if (answer.firstMs === null) answer.firstMs = performance.now() - started;
    answer.text += piece;
    show(answer.text);
  });
  return answer;
}

function drawSources(sources) {
  $("#rag-sources").replaceChildren(...sources.map((s) => element("li", {
    "data-source": s.source,
  }, element("strong", { text: `[${s.n}] ${s.source}` }),
  element("span", { class: "muted", text: ` chars ${s.span[0]}–${s.span[1]} · score ${s.score.toFixed(4)}` }),
  element("p", { text: s.text }))));
}

async function askRag(event) {
  event.preventDefault();
  const question = $("#rag-question").value;
  $("#rag-ask").disabled = true;
  for (const id of ["rag-answer", "stuffed-answer", "rag-cost", "stuffed-cost"]) $(`#${id}`).textContent = "";
  try {
    const began = performance.now();
    const data = await api("/lab/api/rag", {
      question, k: Number($("#rag-k").value), method: $("#rag-method").value,
    });
    drawSources(data.sources);
    const retrieval = performance.now() - began;
    const sides = [["rag", data.conversations.rag, retrieval], ["stuffed", data.conversations.stuffed, 0]];
    for (const [name, messages, before] of sides) {
      const answer = await streamAnswer(messages, (text) => { $(`#${name}-answer`).textContent = text; });
      const ttft = before + (answer.firstMs ?? 0);
      const prompt = answer.usage ? answer.usage.prompt_tokens : "?";
      $(`#${name}-cost`).textContent = `${prompt} prompt tokens · time to first token ${ttft.toFixed(0)} ms`;
      $(`#${name}-cost`).dataset.promptTokens = prompt;
    }
    $("#view-rag").dataset.done = "true";
  } catch (error) {
    showError(error.message);
  } finally {
    $("#rag-ask").disabled = false;
  }
}

function setUpRag() {
  $("#rag-form").addEventListener("submit", askRag);
}
