"""Attention heatmaps (seed 000 §3.3: "可视化注意力画的也是它", the [L x L] matrix A; §4.2: each
head has its own matrix): one matrix, one per layer, or every head of one layer.

Figures are built with matplotlib's object API on the headless Agg canvas, so a user's pyplot
state (backend, open figures) is never touched. Long inputs are cropped to a window of at most
`max_tokens` queries and keys around the chosen query, and the title says so.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

MAX_TOKENS = 48  # most query/key tokens one heatmap shows
CJK_FONTS = (
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "Droid Sans Fallback",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "AR PL UMing CN",
)


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return (
        0x3000 <= code <= 0x9FFF  # CJK punctuation, kana, unified ideographs
        or 0xAC00 <= code <= 0xD7AF  # Hangul
        or 0xF900 <= code <= 0xFAFF  # compatibility ideographs
        or 0xFF00 <= code <= 0xFFEF  # full-width forms (，。！)
        or 0x20000 <= code <= 0x2FFFF
    )


@lru_cache(maxsize=1)
def cjk_font() -> str | None:
    """The name of an installed font that covers CJK (WenQuanYi Micro Hei first), or None."""
    found = _known_cjk_font()
    if found is None:
        # matplotlib's font list is cached on first use: a font installed later (apt-get
        # install fonts-wqy-microhei) is not in it until its file is added.
        for path in font_manager.findSystemFonts():
            if any(key in Path(path).name.lower() for key in ("wqy", "cjk", "droidsansfallback")):
                font_manager.fontManager.addfont(path)
        found = _known_cjk_font()
    return found


def _known_cjk_font() -> str | None:
    installed = {f.name for f in font_manager.fontManager.ttflist}
    for name in CJK_FONTS:
        if name in installed:
            return name
    return next((n for n in sorted(installed) if "CJK" in n or "WenQuanYi" in n), None)


@lru_cache(maxsize=1)
def _warn_no_cjk_font() -> None:
    warnings.warn(
        "no CJK font is installed, so CJK tokens show as boxes: install one, e.g. "
        "apt-get install fonts-wqy-microhei",
        stacklevel=4,
    )


def _font_family(labels: Sequence[str]) -> list[str]:
    """A fallback list: DejaVu Sans for Latin text, then a CJK font if any label needs one."""
    if not any(_is_cjk(c) for label in labels for c in label):
        return ["DejaVu Sans"]
    font = cjk_font()
    if font is None:
        _warn_no_cjk_font()
        return ["DejaVu Sans"]
    return ["DejaVu Sans", font]


def crop_window(n: int, center: int | None, size: int = MAX_TOKENS) -> tuple[int, int]:
    """[start, stop) of at most `size` positions out of n, centered on `center` (or the first
    ones when center is None)."""
    if n <= size:
        return 0, n
    if center is None:
        return 0, size
    start = min(max(center - size // 2, 0), n - size)
    return start, start + size


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # headless canvas of its own: pyplot is never involved
    return fig


def _draw(
    ax: Axes,
    weights: Tensor,
    tokens_q: Sequence[str],
    tokens_k: Sequence[str],
    title: str,
    query: int | None,
    max_tokens: int,
    colorbar: bool = True,
) -> None:
    """One heatmap: rows are queries, columns keys, cropped around the query."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be (queries, keys), got shape {tuple(weights.shape)}")
    n_q, n_k = weights.shape
    if (len(tokens_q), len(tokens_k)) != (n_q, n_k):
        raise ValueError(
            f"{len(tokens_q)} query and {len(tokens_k)} key labels for weights of shape "
            f"({n_q}, {n_k}): give one label per row and per column"
        )
    weights = weights.detach().float().cpu()
    q0, q1 = crop_window(n_q, query, max_tokens)
    # Self-attention: keys around the query itself; otherwise around what the query looks at.
    same = list(tokens_q) == list(tokens_k)
    key_center = query if query is None or same else int(weights[query].argmax())
    k0, k1 = crop_window(n_k, key_center, max_tokens)
    view = weights[q0:q1, k0:k1].numpy()
    if (q1 - q0, k1 - k0) != (n_q, n_k):
        title += f"\n(cropped: queries {q0}-{q1 - 1} of {n_q}, keys {k0}-{k1 - 1} of {n_k})"
    labels_q, labels_k = list(tokens_q[q0:q1]), list(tokens_k[k0:k1])
    family = _font_family(labels_q + labels_k + [title])
    image = ax.imshow(view, cmap="viridis", vmin=0.0, vmax=max(float(view.max()), 1e-6))
    size = max(4.0, min(9.0, 260.0 / max(len(labels_q), len(labels_k))))
    ax.set_xticks(range(len(labels_k)), labels_k, rotation=90, fontsize=size, fontfamily=family)
    ax.set_yticks(range(len(labels_q)), labels_q, fontsize=size, fontfamily=family)
    ax.set_xlabel("key (attended to)", fontsize=8)
    ax.set_ylabel("query (attending)", fontsize=8)
    ax.set_title(title, fontsize=9, fontfamily=family)
    if query is not None and q0 <= query < q1:
        row = query - q0  # outline the chosen query's row: the distribution the CLI prints
        ax.add_patch(Rectangle((-0.5, row - 0.5), k1 - k0, 1, fill=False, color="red", lw=1.2))
        ax.get_yticklabels()[row].set_color("red")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, shrink=0.8)


def attention_heatmap(
    weights: Tensor,
    tokens_q: Sequence[str],
    tokens_k: Sequence[str],
    title: str = "attention",
    query: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Figure:
    """One [Tq, Tk] attention matrix; `query` outlines that row and centers a cropped view."""
    n_q, n_k = weights.shape[-2], weights.shape[-1]
    side_q, side_k = min(n_q, max_tokens), min(n_k, max_tokens)
    fig = _new_figure(min(3 + 0.22 * side_k, 14), min(2.5 + 0.22 * side_q, 14))
    _draw(fig.add_subplot(), weights, tokens_q, tokens_k, title, query, max_tokens)
    return fig


def _grid(
    panels: Sequence[tuple[Tensor, str]],
    tokens_q: Sequence[str],
    tokens_k: Sequence[str],
    suptitle: str,
    query: int | None,
    max_tokens: int,
) -> Figure:
    n = len(panels)
    if n == 0:
        raise ValueError("nothing to plot: no layers or heads were given")
    cols = min(n, 6 if n > 12 else 4)
    rows = math.ceil(n / cols)
    side = min(max(len(tokens_q), len(tokens_k)), max_tokens)
    panel = min(max(2.5, 0.12 * side + 1.5), 6.0)
    fig = _new_figure(cols * panel, rows * panel + 0.6)
    for index, (weights, title) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, index + 1)
        _draw(ax, weights, tokens_q, tokens_k, title, query, max_tokens, colorbar=False)
    fig.suptitle(suptitle, fontfamily=_font_family([suptitle]))
    return fig


def layer_grid(
    weights_per_layer: Sequence[Tensor],
    tokens_q: Sequence[str],
    tokens_k: Sequence[str],
    title: str = "attention per layer (mean over heads)",
    query: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Figure:
    """One heatmap per layer, each the mean over heads. weights_per_layer: L x (H, Tq, Tk)."""
    panels = [(w.float().mean(dim=0), f"layer {i}") for i, w in enumerate(weights_per_layer)]
    return _grid(panels, tokens_q, tokens_k, title, query, max_tokens)


def head_grid(
    layer_weights: Tensor,
    tokens_q: Sequence[str],
    tokens_k: Sequence[str],
    title: str = "attention per head",
    query: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> Figure:
    """Every head of one layer (seed 000 §4.2: h heads, h matrices). layer_weights: (H, Tq, Tk)."""
    panels = [(w, f"head {h}") for h, w in enumerate(layer_weights)]
    return _grid(panels, tokens_q, tokens_k, title, query, max_tokens)


def save(fig: Figure, path: str | Path, dpi: int = 100) -> Path:
    """Write the figure (PNG, or any format matplotlib knows by the suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # Without a CJK font matplotlib warns once per missing glyph; _font_family said it once.
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.savefig(path, dpi=dpi)
    return path
