// glassformer lab, view 4: the 猫/累/它 worked example (seed 002's d = 4 vectors). GET
// /lab/api/worked_example gives the seed's Query, Keys and Values; every edit POSTs them back to
// /lab/api/worked_example, where glassformer.numpy_ref computes softmax(q·Kᵀ / √d) and the output
// weights · V. A field that is not a finite number is refused here, by name. Needs common.js.
"use strict";

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

// A field that is empty, not a number or beyond ±1.8e308 (type=number then reads "" or
// Infinity) is refused here, by name: Number("") is 0, and JSON has no Infinity.
function readNumber(input) {
  const text = input.value.trim();
  const value = Number(text);
  if (text === "" || input.validity.badInput || !Number.isFinite(value)) {
    const label = input.getAttribute("aria-label") || input.id;
    const shown = text || "(empty)";
    throw new Error(`${label}: “${shown}” is not a finite number; type one, such as 0.5`);
  }
  return value;
}

function workedBody() {
  const example = worked.defaults;
  const read = (id) => readNumber($(`#${id}`));
  const d = example.q.length;
  const vectors = (name) => example.tokens.map((_, t) =>
    Array.from({ length: d }, (_, i) => read(`worked-${name}-${t}-${i}`)));
  return {
    q: Array.from({ length: d }, (_, i) => read(`worked-q-${i}`)),
    K: vectors("K"),
    V: vectors("V"),
    divide_by_sqrt_d: $("#worked-sqrt").checked,
    key_scale: readNumber($("#worked-key-scale")),
  };
}

// A score beyond ±1.8e308 overflows to infinity, and the softmax of it is NaN (JSON null):
// such an answer is an error, not a table.
function checkFinite(result) {
  const numbers = [result.scale, ...result.scores, ...result.weights, ...result.output];
  if (numbers.every((x) => typeof x === "number" && Number.isFinite(x))) return result;
  throw new Error("the scores overflow (q·k × scale is beyond ±1.8e308), so the weights are "
    + "not numbers: use smaller Query, Key or scale values");
}

// An error clears the table: numbers from before the edit must not stand beside it.
function failWorked(message) {
  $("#worked-weights").replaceChildren();
  const output = $("#worked-output");
  output.textContent = "";
  output.parentElement.hidden = true;
  delete output.dataset.values;
  const box = $("#worked-error");
  box.textContent = `error: ${message}`;
  box.hidden = false;
}

function drawWorked(result) {
  $("#worked-error").hidden = true;
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
  output.parentElement.hidden = false;
  output.dataset.values = JSON.stringify(result.output);
  output.textContent = `[${result.output.map((x) => x.toFixed(2)).join(", ")}]`;
}

const refreshWorked = latest(async () => {
  const result = checkFinite(await api("/lab/api/worked_example", workedBody()));
  return { draw: () => drawWorked(result) };
}, 20, failWorked);

async function resetWorked() {
  try {
    worked.defaults = worked.defaults || await api("/lab/api/worked_example");
  } catch (error) {
    failWorked(error.message);
    return;
  }
  buildWorkedInputs(worked.defaults);
  $("#worked-sqrt").checked = true;
  $("#worked-key-scale").value = 1;
  refreshWorked();
}

function setUpWorked() {
  $("#worked-inputs").addEventListener("input", () => refreshWorked());
  $("#worked-sqrt").addEventListener("change", () => refreshWorked());
  $("#worked-key-scale").addEventListener("input", () => refreshWorked());
  $("#worked-times-ten").addEventListener("click", () => {
    $("#worked-key-scale").value = Number($("#worked-key-scale").value) * 10;
    refreshWorked();
  });
  $("#worked-reset").addEventListener("click", resetWorked);
}
