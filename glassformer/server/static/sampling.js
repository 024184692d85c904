// glassformer lab, view 2: the sampling layer. POST /lab/api/next_tokens gives the model's
// next-token candidates and the distribution infer.sampling draws from under the temperature,
// top-k, top-p and min-p sliders; POST /lab/api/sample draws one token with the library's own
// sampler. A candidate clicked, or a token drawn, becomes the next step. Needs common.js.
"use strict";

// steps: the tokens so far, each {id, piece, prob, how}: prob is the sampler's probability of
// that token under the settings of its step.
const sampling = { steps: [] };

// 12.3%, or two significant digits for a rare token: 0.0042%.
const percent = (p) => (p >= 0.001 || p === 0
  ? `${(p * 100).toFixed(1)}%` : `${(p * 100).toPrecision(2)}%`);

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
    ids: sampling.steps.map((step) => step.id),
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
    choose.addEventListener("click", () => addStep({
      id: candidate.id, piece: candidate.piece, prob: candidate.prob, how: "chose",
    }));
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

function drawSteps() {
  const { steps } = sampling;
  const last = steps[steps.length - 1];
  $("#sampling-drawn").textContent = last
    ? `step ${steps.length}: ${last.how} “${shownPiece(last.piece)}” (token ${last.id}), `
      + `probability ${percent(last.prob)} under the settings of that step`
    : "";
  $("#sampling-steps").replaceChildren(...steps.map((step, n) => element("li", {
    "data-id": step.id, "data-prob": step.prob, "data-how": step.how,
    title: `step ${n + 1}: ${step.how} token ${step.id}`,
  }, element("span", { class: "piece", text: shownPiece(step.piece) }),
  element("small", { text: percent(step.prob) }))));
}

function addStep(step) {
  sampling.steps = [...sampling.steps, step];
  drawSteps();
  refreshSampling();
}

function resetSteps() {
  sampling.steps = [];
  drawSteps();
  refreshSampling();
}

const refreshSampling = latest(async () => {
  const result = await api("/lab/api/next_tokens", samplingSettings());
  return { draw: () => drawCandidates(result) };
});

// The server draws with infer.sampling.sample and says the token's probability (prob: under the
// distribution the candidates show).
async function sampleOne() {
  try {
    const drawn = await api("/lab/api/sample", samplingSettings());
    addStep({ id: drawn.id, piece: drawn.piece, prob: drawn.prob, how: "drew" });
  } catch (error) {
    showError(error.message);
  }
}

function setUpSampling() {
  for (const id of ["#temperature", "#top-k", "#top-p", "#min-p", "#sampling-chat"]) {
    $(id).addEventListener("input", () => refreshSampling());
  }
  $("#sampling-prompt").addEventListener("input", resetSteps);
  $("#sample-one").addEventListener("click", sampleOne);
  $("#sampling-reset").addEventListener("click", resetSteps);
}
