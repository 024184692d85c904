"""Looking inside (seed 000 §3.3, §4.2; seed 002's "它 -> 猫" demo): capture every head's attention
weights and the residual stream, read which tokens a token attends to, and plot the matrices.

    import glassformer as gf
    with gf.inspect.capture(model) as cap:
        model(ids)
    cap.attention[0]      # (B, H, Tq, Tk) weights of layer 0
    with gf.inspect.ablate_heads(model, {0: [1, 3]}):
        model(ids)        # heads 1 and 3 of layer 0 contribute nothing
"""

from glassformer.inspect.ablate import ablate_heads, all_heads, as_spec
from glassformer.inspect.capture import (
    Attended,
    AttentionView,
    Capture,
    LayerRecords,
    attention_view,
    capture,
    find_token,
    token_texts,
    top_attended,
)

__all__ = [
    "Attended",
    "AttentionView",
    "Capture",
    "LayerRecords",
    "ablate_heads",
    "all_heads",
    "as_spec",
    "attention_view",
    "capture",
    "find_token",
    "token_texts",
    "top_attended",
]
