// glassformer lab, view 5: the token counter. POST /lab/api/tokenize splits the text with
// glassformer.tokenize under every vocabulary at hand and gives each one's pieces, ids and count;
// a piece that is only part of a character is shown as its bytes in hex. Needs common.js.
"use strict";

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

function setUpTokens() {
  $("#tokens-text").addEventListener("input", () => refreshTokens());
  for (const preset of document.querySelectorAll(".token-preset")) {
    preset.addEventListener("click", () => {
      $("#tokens-text").value = preset.dataset.text;
      refreshTokens();
    });
  }
}
