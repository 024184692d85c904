// glassformer lab, view 3: the attention explorer. POST /lab/api/attention returns
// inspect.attention_view's weights for a sentence, every layer and head (H, T, T) per layer:
// drawn as a layer × head grid of small maps, the picked layer's (or head's) matrix, and the row
// of the query token under the pointer. Tokens the vocabulary lacks ([UNK]) or splits into byte
// pieces are marked, with the server's note on what their weights can say. Needs common.js.
"use strict";

const attention = { data: null, layer: 0, head: 0, query: 0, kinds: [] };

// inspect's label of one byte piece of a character: "猫(1/3)".
const PIECE = /\((\d+)\/(\d+)\)$/;

// token_kinds[i] (server/lab_tokens.py): "token", "unk" (not in the vocabulary: [UNK]) or
// "byte" (part of a character's UTF-8 bytes).
function kindTitle(kind) {
  if (kind === "unk") return "[UNK]: not in this model's vocabulary";
  return kind === "byte" ? "one byte piece of a character" : "";
}

// What the weights can and cannot say for this text (the server's note on its [UNK] and byte
// pieces), with the seed's English pair, whose words are whole tokens.
function drawHonesty(data) {
  $("#attention-note").textContent = data.note || "";
  $("#legend-unk").hidden = !data.token_kinds.includes("unk");
  $("#legend-byte").hidden = !data.token_kinds.includes("byte");
  $("#attention-honesty").hidden = !data.note;
}

// The query row to open with: "it" / "它" (for a character split into byte pieces, its last
// piece: the first position that has read the whole character).
function defaultQuery(tokens) {
  const at = tokens.findIndex((t) => {
    const bare = t.replace(PIECE, "");
    return bare.toLowerCase() === "it" || bare === "它";
  });
  if (at < 0) return tokens.length - 1;
  const piece = tokens[at].match(PIECE);
  return piece ? at + Number(piece[2]) - Number(piece[1]) : at;
}

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
    class: `key ${attention.kinds[k]}`, "data-key": k, "data-weight": weight,
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
  attention.query = defaultQuery(data.tokens);
  attention.kinds = data.token_kinds;
  drawHonesty(data);
  $("#attention-tokens").replaceChildren(...data.tokens.map((token, index) => {
    const kind = attention.kinds[index];
    const what = kind === "token" ? "" : ` (${kindTitle(kind)})`;
    const chip = element("button", {
      type: "button", class: `token ${kind}`, "data-index": index, "data-kind": kind, text: token,
      title: kindTitle(kind), "aria-label": `query token ${index}: ${token}${what}`,
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
  const asked = { text: $("#attention-text").value, which: $("#attention-model").value };
  try {
    drawAttention(await api("/lab/api/attention", asked));
    Object.assign($("#attention-tokens").dataset, asked);  // what the chips are the tokens of
  } catch (error) {
    showError(error.message);
  }
}

function setUpAttention() {
  $("#attention-form").addEventListener("submit", loadAttention);
  $("#attention-average").addEventListener("change", () => attention.data && drawSelection());
  for (const preset of document.querySelectorAll(".preset, .english-pair")) {
    preset.addEventListener("click", () => {
      $("#attention-text").value = preset.dataset.text;
      loadAttention();
    });
  }
}
