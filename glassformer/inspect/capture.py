"""Seeing inside a forward pass: every head's [L x L] attention matrix (seed 000 §3.3, §4.2) and
the residual stream after each block (seed 000 §5.3), recorded by a context manager.

Shapes: B batch, H heads, Tq/Tk query/key positions, T time, C channels (d_model).

    with gf.inspect.capture(model) as cap:
        model(ids)
    cap.attention[layer]   # (B, H, Tq, Tk), each row a softmax distribution over the keys
    cap.residual[layer]    # (B, T, C), the stream after block `layer`

Inside the block every Attention module runs the eager path (the six steps of §3.3, which can
return the weights); on exit the modules are put back on their fast path and the hooks removed,
also when the forward raises. Only Attention modules and block outputs are touched, so a model
with DecodeLinear / Int8Linear layers (glassformer.infer.optimize, glassformer.nn.quant) is
captured the same way.

Several forward calls (generation with a KV cache: a prefill, then one call per new token) each
append one record per layer: `cap.attention[layer]` is the LAST call's weights, and
`cap.attention.calls(layer)` lists every call's in order (prefill (B, H, T, T), then decode
steps (B, H, 1, T + i)). `cap.attention.full(layer)` stitches those rows back into one
(B, H, T_total, T_total) matrix, zero where a key did not exist yet.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from glassformer.nn.attention import Attention

# Which attention modules a family has, as (kind, stack attribute, attention attribute).
# Seq2seq has three kinds (seed 000 §6.1): the encoder's and decoder's self-attention and the
# decoder's cross-attention (queries from the decoder, keys from the encoder's output).
ATTENTION_KINDS: dict[str, list[tuple[str, str, str]]] = {
    "gpt": [("self", "blocks", "attn")],
    "bert": [("self", "blocks", "attn")],
    "seq2seq": [
        ("encoder", "encoder", "attn"),
        ("decoder", "decoder", "attn"),
        ("cross", "decoder", "cross_attn"),
    ],
}
# Which block stacks carry a residual stream, per family.
RESIDUAL_STACKS: dict[str, list[str]] = {
    "gpt": ["blocks"],
    "bert": ["blocks"],
    "seq2seq": ["encoder", "decoder"],
}


class LayerRecords(Sequence):
    """One record list per layer. records[layer] is the last call's tensor; calls(layer) all."""

    def __init__(self, name: str, per_layer: list[list[Tensor]]) -> None:
        self.name = name
        self._per_layer = per_layer

    def __len__(self) -> int:
        return len(self._per_layer)

    def __getitem__(self, layer: int) -> Tensor:  # type: ignore[override]
        calls = self.calls(layer)
        if not calls:
            raise ValueError(
                f"nothing recorded for {self.name} layer {layer}: run the model inside the "
                "`with capture(model)` block"
            )
        return calls[-1]

    def calls(self, layer: int) -> list[Tensor]:
        """Every recorded call of this layer, oldest first."""
        if not -len(self) <= layer < len(self):
            raise IndexError(
                f"layer {layer} does not exist: {self.name} has layers 0..{len(self) - 1}"
            )
        return self._per_layer[layer]

    @property
    def n_calls(self) -> int:
        return len(self._per_layer[0]) if self._per_layer else 0

    def full(self, layer: int) -> Tensor:
        """Attention weights of all calls as one (B, H, sum Tq, max Tk) matrix, for a KV-cache
        generation: each call's rows are placed under the previous ones, the keys that did not
        exist yet are 0 (as the causal mask makes them in one full forward)."""
        calls = self.calls(layer)
        if not calls:
            return self[layer]  # raises the "nothing recorded" error
        n_keys = max(c.shape[-1] for c in calls)
        rows = [torch.nn.functional.pad(c, (0, n_keys - c.shape[-1])) for c in calls]
        return torch.cat(rows, dim=2)  # (B, H, sum Tq, Tk)


@dataclass
class Capture:
    """What one `capture` block recorded.

    attention_by_kind: "self" for GPT and BERT; "encoder", "decoder", "cross" for seq2seq.
    residual_by_stack: "blocks" for GPT and BERT; "encoder", "decoder" for seq2seq.
    """

    family: str
    attention_by_kind: dict[str, LayerRecords] = field(default_factory=dict)
    residual_by_stack: dict[str, LayerRecords] = field(default_factory=dict)

    @property
    def attention(self) -> LayerRecords:
        """The self-attention of a one-stack model (GPT, BERT): attention[layer] (B, H, Tq, Tk)."""
        return self._only(self.attention_by_kind, "attention_by_kind")

    @property
    def residual(self) -> LayerRecords:
        """The residual stream after each block of a one-stack model: residual[layer] (B, T, C)."""
        return self._only(self.residual_by_stack, "residual_by_stack")

    def _only(self, records: dict[str, LayerRecords], name: str) -> LayerRecords:
        if len(records) != 1:
            keys = ", ".join(repr(k) for k in records)
            raise ValueError(
                f"a {self.family} model records several stacks ({keys}): use cap.{name}[kind]"
            )
        return next(iter(records.values()))


def _family(model: nn.Module) -> str:
    cfg = getattr(model, "cfg", None)
    family = getattr(cfg, "family", None)
    if family == "rnn":
        raise ValueError(
            "an RNN has no attention to capture: it reads the sequence one step at a time "
            "through its hidden state (seed 000 §1); inspect a gpt, bert or seq2seq model"
        )
    if family not in ATTENTION_KINDS:
        raise ValueError(
            f"capture needs a glassformer model of family {', '.join(ATTENTION_KINDS)}, got "
            f"{type(model).__name__} (family={family!r}): build it with gf.build_model or load "
            "it with gf.from_pretrained"
        )
    return family


@contextmanager
def capture(model: nn.Module, residual: bool = True) -> Iterator[Capture]:
    """Record attention weights (eager path) and, with residual=True, block outputs of every
    forward run inside the block. Everything is restored on exit, also on an exception."""
    family = _family(model)
    cap = Capture(family)
    modules: list[Attention] = []
    for kind, stack_name, attn_name in ATTENTION_KINDS[family]:
        stack = getattr(model, stack_name)
        attns = [getattr(block, attn_name) for block in stack]
        busy = [m for m in attns if m.weights_sink is not None]
        if busy:
            raise ValueError(
                f"{kind} attention is already being captured (weights_sink is set): leave the "
                "other `with capture(model)` block first; captures do not nest"
            )
        modules += attns
        cap.attention_by_kind[kind] = LayerRecords(f"{kind} attention", [[] for _ in attns])
    handles = []
    try:
        for kind, stack_name, attn_name in ATTENTION_KINDS[family]:
            stack = getattr(model, stack_name)
            records = cap.attention_by_kind[kind]
            for layer, block in enumerate(stack):
                # The module appends its (B, H, Tq, Tk) weights here on every call.
                getattr(block, attn_name).weights_sink = records.calls(layer)
        if residual:
            for stack_name in RESIDUAL_STACKS[family]:
                stack = getattr(model, stack_name)
                per_layer: list[list[Tensor]] = [[] for _ in stack]
                cap.residual_by_stack[stack_name] = LayerRecords(
                    f"{stack_name} residual", per_layer
                )
                for layer, block in enumerate(stack):
                    handles.append(block.register_forward_hook(_residual_hook(per_layer[layer])))
        yield cap
    finally:
        for module in modules:
            module.weights_sink = None  # back on the fast path (sdpa when configured)
        for handle in handles:
            handle.remove()


def _residual_hook(sink: list[Tensor]):
    def hook(module: nn.Module, args, output: Tensor) -> None:
        sink.append(output.detach())  # (B, T, C)

    return hook


# --- reading the weights -----------------------------------------------------------------------


@dataclass
class Attended:
    """One key a query attends to: its mean weight over heads and the head that looks most."""

    key: int
    mean_weight: float
    best_head: int
    best_head_weight: float


def top_attended(row: Tensor, k: int = 3) -> list[Attended]:
    """row: (H, Tk) one query's weights in every head -> the k keys with the largest mean over
    heads (as seed 002's demo: att.mean(0), topk), each with its most attentive head."""
    if row.dim() != 2:
        raise ValueError(f"row must be (heads, keys), got shape {tuple(row.shape)}")
    row = row.float()
    mean = row.mean(dim=0)  # (Tk,)
    best_weight, best_head = row.max(dim=0)  # (Tk,), (Tk,)
    top = torch.topk(mean, min(k, mean.numel()))
    return [
        Attended(int(i), float(mean[i]), int(best_head[i]), float(best_weight[i]))
        for i in top.indices
    ]


# --- naming tokens -------------------------------------------------------------------------------

# Word-start / continuation markers of byte-level BPE (GPT-2 "Ġ", newline "Ċ"), WordPiece "##" and
# SentencePiece "▁": stripped when matching a token by its text.
TOKEN_MARKERS = ("Ġ", "Ċ", "##", "▁")


def _raw_token(tokenizer, token_id: int) -> str | None:
    if hasattr(tokenizer, "id_to_token"):
        return tokenizer.id_to_token(token_id)
    hf = getattr(tokenizer, "hf", None)
    return hf.id_to_token(token_id) if hf is not None else None


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """A readable label per token: its own decoded text ("it", "它", " the" -> "the"), or the raw
    vocabulary entry when a token alone is not valid UTF-8 (part of a multi-byte character)."""
    labels = []
    for index, token_id in enumerate(ids):
        text = tokenizer.decode([token_id])
        if "\ufffd" in text:
            piece = _split_character(tokenizer, ids, index)
            text = piece or _raw_token(tokenizer, token_id) or text
        shown = text.strip()
        if not shown:
            shown = {"\n": "\\n", "\t": "\\t"}.get(text[:1], "␣")  # whitespace made visible
        labels.append(shown)
    return labels


def _split_character(tokenizer, ids: Sequence[int], index: int) -> str | None:
    """Byte-level BPE splits a character like 它 into several tokens, none valid UTF-8 alone:
    label each piece with the whole character and which piece it is, e.g. "它(1/2)"."""
    for start in range(index, max(index - 4, -1), -1):
        for stop in range(index + 1, min(index + 5, len(ids)) + 1):
            text = tokenizer.decode(list(ids[start:stop]))
            if "\ufffd" not in text and text.strip():
                return f"{text.strip()}({index - start + 1}/{stop - start})"
    return None


def _match_key(text: str) -> str:
    text = re.sub(r"\(\d+/\d+\)$", "", text)  # a piece of a split character matches it
    for marker in TOKEN_MARKERS:
        text = text.replace(marker, "")
    return text.strip()


def find_token(tokenizer, ids: Sequence[int], token: str) -> tuple[int, str | None]:
    """The position of the first token whose text is `token` (markers like Ġ ## ▁ ignored; case
    ignored if no exact match), and a note when it occurs several times."""
    labels = token_texts(tokenizer, ids)
    keys = [
        {_match_key(label), _match_key(_raw_token(tokenizer, i) or label)}
        for label, i in zip(labels, ids, strict=True)
    ]
    wanted = _match_key(token)
    hits = [p for p, k in enumerate(keys) if wanted in k]
    if not hits:
        hits = [p for p, k in enumerate(keys) if wanted.lower() in {s.lower() for s in k}]
    if not hits:
        shown = " ".join(f"{p}:{label}" for p, label in enumerate(labels[:60]))
        more = f" ... ({len(labels) - 60} more)" if len(labels) > 60 else ""
        raise ValueError(
            f"token {token!r} is not one of the input's {len(labels)} tokens: {shown}{more}; "
            "pass one of them to --token, or a number to --position"
        )
    # A character split over n byte-level pieces counts once, at its last piece: the first
    # position where a causal model has read all of its bytes.
    pieces = [re.search(r"\((\d+)/(\d+)\)$", labels[p]) for p in hits]
    hits = [p + int(m[2]) - int(m[1]) if m else p for p, m in zip(hits, pieces, strict=True)]
    hits = sorted(set(hits))
    note = None
    if len(hits) > 1:
        note = (
            f"{token!r} occurs {len(hits)} times (positions {', '.join(map(str, hits))}): "
            f"using the first, position {hits[0]}; pick another with --position"
        )
    return hits[0], note


# --- one text, one query: what `glassformer inspect attention` shows ---------------------------


@dataclass
class AttentionView:
    """One kind of attention of one text, batch row 0, every layer.

    weights[layer]: (H, Tq, Tk) float32; query: the chosen row; notes: what was adjusted
    (input cut to max_tokens, a token that occurs several times)."""

    kind: str
    query_tokens: list[str]
    key_tokens: list[str]
    query: int
    weights: list[Tensor]
    notes: list[str] = field(default_factory=list)


def _encode(model: nn.Module, tokenizer, text: str) -> list[int]:
    ids = list(tokenizer.encode(text))
    if model.cfg.family == "bert" and hasattr(tokenizer, "token_to_id"):
        # A pretrained BERT tokenizer adds [CLS] ... [SEP] itself; one trained here does not.
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        if cls is not None and (not ids or ids[0] != cls):
            ids.insert(0, cls)
        if sep is not None and ids[-1] != sep:
            ids.append(sep)
    if not ids:
        raise ValueError("the text encodes to no tokens: give a non-empty text")
    return ids


def _decoder_input(model: nn.Module, tokenizer, src: Tensor, target: str | None) -> list[int]:
    """[start] + the target's ids, or + the model's own greedy output when no target is given."""
    start = model.decoder_start_token_id
    limit = model.cfg.max_seq_len
    if target is not None:
        return [start, *tokenizer.encode(target)][:limit]
    from glassformer.infer.seq2seq_decode import greedy_decode

    steps = min(limit - 1, 2 * src.shape[1] + 8)
    out = greedy_decode(model, src, max_new_tokens=steps)[0]
    eos = model.cfg.eos_token_id
    if out and out[-1] == eos:
        out = out[:-1]  # the query rows are the inputs that produced each next token
    return [start, *out]


@torch.no_grad()
def attention_view(
    model: nn.Module,
    tokenizer,
    text: str,
    *,
    token: str | None = None,
    position: int | None = None,
    kind: str | None = None,
    target: str | None = None,
    max_tokens: int = 512,
) -> AttentionView:
    """Run `text` through the model under capture and pick one query row.

    kind: "self" (GPT, BERT) or "encoder" | "decoder" | "cross" (seq2seq, default "encoder");
    token: the query token's text, position: its index (default: the last token);
    target: the seq2seq decoder's text (default: the model's greedy output for `text`)."""
    family = _family(model)
    kinds = [k for k, _, _ in ATTENTION_KINDS[family]]
    kind = kind or kinds[0]
    if kind not in kinds:
        raise ValueError(f"kind={kind!r} is not an attention of a {family} model: pick {kinds}")
    if token is not None and position is not None:
        raise ValueError(f"give --token {token!r} or --position {position}, not both")
    notes: list[str] = []
    src_ids = _encode(model, tokenizer, text)
    limit = min(max_tokens, model.cfg.max_seq_len)
    if len(src_ids) > limit:
        notes.append(f"the text has {len(src_ids)} tokens: using the first {limit}")
        src_ids = src_ids[:limit]
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], device=device)  # (1, T)
    if family == "seq2seq":
        dec_ids = _decoder_input(model, tokenizer, src, target)
        dec = torch.tensor([dec_ids], device=device)  # (1, Tdec)
        q_ids = src_ids if kind == "encoder" else dec_ids
        k_ids = dec_ids if kind == "decoder" else src_ids
    else:
        q_ids = k_ids = src_ids
    if token is not None:
        query, note = find_token(tokenizer, q_ids, token)
        if note:
            notes.append(note)
    elif position is not None:
        if not -len(q_ids) <= position < len(q_ids):
            raise ValueError(
                f"position {position} is outside the {len(q_ids)} query tokens: pick 0.."
                f"{len(q_ids) - 1}"
            )
        query = position % len(q_ids)
    else:
        query = len(q_ids) - 1
    was_training = model.training
    model.eval()  # no dropout: the weights are the model's, not a random thinning of them
    try:
        with capture(model, residual=False) as cap:
            if family == "seq2seq":
                model(src, dec)
            else:
                model(src)
    finally:
        model.train(was_training)
    records = cap.attention_by_kind[kind]
    weights = [records[layer][0].float() for layer in range(len(records))]  # L x (H, Tq, Tk)
    return AttentionView(
        kind, token_texts(tokenizer, q_ids), token_texts(tokenizer, k_ids), query, weights, notes
    )
