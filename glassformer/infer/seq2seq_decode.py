"""Decoding for the encoder-decoder (seed 000 §6.1): greedy and beam search.

Both encode the source once, then run the decoder one token at a time with a Seq2SeqCache: the
decoder's self-attention keys/values grow by one position per step, the cross-attention
keys/values are projected from the memory once. Beam search follows Hugging Face transformers'
algorithm step for step (top 2k candidates, hypotheses scored sum(log p) / length**penalty,
the same early-stopping rules), so its output can be compared with `generate(num_beams=k)`.

Token ids in, token ids out: no tokenizer here. Returned sequences leave out the decoder start
token and keep the end-of-sequence token when one was produced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from glassformer.models.seq2seq import Seq2Seq, Seq2SeqCache


@dataclass
class Hypothesis:
    score: float  # sum of token log-probs / len(tokens) ** length_penalty
    tokens: list[int]  # without the start token; ends with eos when it finished


def _eos(model: Seq2Seq, eos_token_id: int | None) -> int | None:
    return model.cfg.eos_token_id if eos_token_id is None else eos_token_id


@torch.no_grad()
def greedy_decode(
    model: Seq2Seq,
    src_ids: Tensor,
    src_padding_mask: Tensor | None = None,
    max_new_tokens: int = 64,
    eos_token_id: int | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """The most likely next token at every step, for a (B, S) batch of sources.

    eos_token_id: None means the config's; a row stops after producing it. Returns B lists of
    new ids (start token left out, eos kept)."""
    eos = _eos(model, eos_token_id)
    B = src_ids.shape[0]
    memory = model.encode(src_ids, src_padding_mask)  # (B, S, C)
    cache = model.new_cache(B, max_new_tokens + 1) if use_cache else None
    tokens = torch.full((B, 1), model.decoder_start_token_id, device=src_ids.device)  # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
    for _ in range(max_new_tokens):
        start = tokens.shape[1] - 1 if cache is not None else 0  # the cache holds the rest
        logits = model.decode(
            tokens[:, start:], memory, src_padding_mask, cache, last_token_only=True, start=start
        )
        next_ids = logits[:, -1].argmax(dim=-1)  # (B,)
        tokens = torch.cat((tokens, next_ids[:, None]), dim=1)
        if eos is not None:
            done |= next_ids == eos
            if bool(done.all()):
                break
    out = []
    for row in tokens[:, 1:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        out.append(row)
    return out


@torch.no_grad()
def beam_hypotheses(
    model: Seq2Seq,
    src_ids: Tensor,
    src_padding_mask: Tensor | None = None,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    max_new_tokens: int = 64,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    early_stopping: bool | str = False,
) -> list[Hypothesis]:
    """Beam search over one source (1, S); the up-to-beam_size finished hypotheses, best first.

    early_stopping as in transformers: False stops when the best running beam, scored at its
    current length, cannot beat the worst finished hypothesis; True stops as soon as beam_size
    hypotheses have finished; "never" assumes a running beam could still grow to max length.
    A hypothesis finishes on eos or at max_new_tokens."""
    if src_ids.dim() != 2 or src_ids.shape[0] != 1:
        raise ValueError(
            f"beam search decodes one source at a time: src_ids must be (1, S), got "
            f"{tuple(src_ids.shape)}; loop over the batch"
        )
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    eos = _eos(model, eos_token_id)
    memory = model.encode(src_ids, src_padding_mask).expand(beam_size, -1, -1)  # (k, S, C)
    if src_padding_mask is not None:
        src_padding_mask = src_padding_mask.expand(beam_size, -1)
    cache: Seq2SeqCache | None = (
        model.new_cache(beam_size, max_new_tokens + 1) if use_cache else None
    )
    device = src_ids.device
    running = torch.full((beam_size, 1), model.decoder_start_token_id, device=device)  # (k, t)
    # Only the first beam is live at the start, so the k beams do not pick the same tokens.
    running_scores = torch.full((beam_size,), -1e9, device=device)
    running_scores[0] = 0.0
    finished: list[Hypothesis] = []
    may_improve = True  # transformers' "early stop heuristic unsatisfied"
    n_candidates = 2 * beam_size  # enough that k beams survive even if k candidates end in eos
    for step in range(max_new_tokens):
        start = running.shape[1] - 1 if cache is not None else 0  # the cache holds the rest
        logits = model.decode(
            running[:, start:], memory, src_padding_mask, cache, last_token_only=True, start=start
        )
        log_probs = logits[:, -1].float().log_softmax(dim=-1)  # (k, V)
        vocab_size = log_probs.shape[-1]
        total = (log_probs + running_scores[:, None]).view(-1)  # (k * V,)
        top_scores, top_index = total.topk(n_candidates)  # (2k,)
        parents, next_ids = top_index // vocab_size, top_index % vocab_size
        candidates = torch.cat((running[parents], next_ids[:, None]), dim=1)  # (2k, t + 1)
        last_step = step == max_new_tokens - 1
        ends = torch.full_like(next_ids, last_step, dtype=torch.bool)
        if eos is not None:
            ends |= next_ids == eos

        # Finished: only among the top k candidates, scored with the length penalty.
        length = step + 1  # new tokens, eos included
        beams_full = len(finished) == beam_size and early_stopping is True
        if may_improve and not beams_full:
            for i in range(beam_size):
                if ends[i]:
                    score = float(top_scores[i]) / length**length_penalty
                    finished.append(Hypothesis(score, candidates[i, 1:].tolist()))
            finished = sorted(finished, key=lambda h: -h.score)[:beam_size]

        # Running: the best k candidates that did not end.
        live_scores = top_scores - ends.float() * 1e9
        keep = live_scores.topk(beam_size).indices  # (k,)
        running, running_scores = candidates[keep], live_scores[keep]
        if cache is not None:
            cache.reorder(parents[keep])

        if bool(ends.all()):
            break
        if early_stopping is True and len(finished) == beam_size:
            break
        best_length = length
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_new_tokens
        best_possible = float(running_scores[0]) / best_length**length_penalty
        if len(finished) == beam_size and best_possible <= finished[-1].score:
            may_improve = False
        if not may_improve:
            break
    return finished


def beam_search(
    model: Seq2Seq,
    src_ids: Tensor,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    max_new_tokens: int = 64,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    src_padding_mask: Tensor | None = None,
    early_stopping: bool | str = False,
) -> list[int]:
    """The best hypothesis of beam search over one (1, S) source: new ids, start token left
    out (see beam_hypotheses for the scores and the other finished hypotheses)."""
    hypotheses = beam_hypotheses(
        model,
        src_ids,
        src_padding_mask,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        use_cache=use_cache,
        early_stopping=early_stopping,
    )
    return hypotheses[0].tokens


def sequence_score(
    model: Seq2Seq,
    src_ids: Tensor,
    tokens: list[int],
    length_penalty: float = 1.0,
    src_padding_mask: Tensor | None = None,
) -> float:
    """sum(log p(token)) / len(tokens)**length_penalty of one continuation of a (1, S) source,
    by one teacher-forced pass: the score beam search gives a finished hypothesis."""
    start = model.decoder_start_token_id
    tgt = torch.tensor([[start, *tokens]], device=src_ids.device)  # (1, 1 + n)
    with torch.no_grad():
        log_probs = model(src_ids, tgt[:, :-1], src_padding_mask).float().log_softmax(-1)
    total = log_probs[0].gather(-1, tgt[0, 1:, None]).sum()
    return float(total) / len(tokens) ** length_penalty
