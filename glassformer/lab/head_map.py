"""The layer x head heat map the head-finding experiments draw (induction heads, previous-token
heads): one value in 0..1 per head."""

from __future__ import annotations

from torch import Tensor


def head_map(ax, values: Tensor, title: str):
    """values (L, H) as a heat map on ax, heads across, layers down; the image, for a colorbar."""
    image = ax.imshow(values.numpy(), cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
    n_layers, n_heads = values.shape
    ax.set(
        xlabel="head",
        ylabel="layer",
        title=title,
        xticks=range(n_heads),
        yticks=range(0, n_layers, max(1, n_layers // 10)),
    )
    ax.tick_params(labelsize=7)
    return image
