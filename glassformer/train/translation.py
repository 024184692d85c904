"""Translation with the encoder–decoder (seed 000 §6.1): First Folio spelling -> modern spelling.

The task feeds the trainer (source, target) pairs from data/parallel.py: src_ids padded with a
padding mask, tgt_ids = [<s>] + target (teacher forcing), targets = target + [</s>] with -100
at padding. Whole plays are held out. Evaluation decodes the held-out pairs and scores them
with sacrebleu's chrF and BLEU next to the copy-the-input baseline (the Folio text unchanged),
which is what a model must beat: spelling normalization is mostly copying.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from glassformer.config import ConfigError, ModelConfig
from glassformer.data import IGNORE_INDEX, batch_indices
from glassformer.data.parallel import (  # noqa: F401  (corpus_split, split_of: re-exported)
    SPLITS,
    TEST_PLAYS,
    VALIDATION_PLAYS,
    ParallelPair,
    corpus_split,
    in_split,
    parallel_corpus,
    split_of,
)
from glassformer.tokenizers import BPETokenizer, require_token_ids
from glassformer.train.config import RunConfig
from glassformer.train.tasks import Task, unigram_entropy

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in a tokenizer trained here


def train_translation_tokenizer(texts: Sequence[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE shared by both sides, with <pad> <s> </s>. vocab_size=259 leaves it
    at bytes (256 + 3 specials, no merges): one token per character of this ASCII corpus, so
    copying a letter is copying a token."""
    return BPETokenizer.train(texts, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    bos: int
    eos: int

    @classmethod
    def of(cls, tokenizer) -> SpecialIds:
        ids = dict(
            zip(
                SPECIAL_TOKENS,
                require_token_ids(
                    tokenizer,
                    SPECIAL_TOKENS,
                    "the translation task (let it train its own tokenizer)",
                ),
                strict=True,
            )
        )
        return cls(ids[PAD], ids[BOS], ids[EOS])


def collate(
    examples: Sequence[tuple[list[int], list[int]]], ids: SpecialIds
) -> dict[str, torch.Tensor]:
    """(source ids, target ids) pairs -> the batch model.loss takes, padded to the longest:
    src_ids (B, S), src_padding_mask (B, S) True at real tokens, tgt_ids (B, T) = <s> + target,
    targets (B, T) = target + </s>, -100 at padding."""
    S = max(len(src) for src, _ in examples)
    T = max(len(tgt) for _, tgt in examples) + 1
    B = len(examples)
    src_ids = torch.full((B, S), ids.pad, dtype=torch.long)
    src_padding_mask = torch.zeros((B, S), dtype=torch.bool)
    tgt_ids = torch.full((B, T), ids.pad, dtype=torch.long)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    for row, (src, tgt) in enumerate(examples):
        src_ids[row, : len(src)] = torch.tensor(src, dtype=torch.long)
        src_padding_mask[row, : len(src)] = True
        tgt_ids[row, : len(tgt) + 1] = torch.tensor([ids.bos, *tgt], dtype=torch.long)
        targets[row, : len(tgt) + 1] = torch.tensor([*tgt, ids.eos], dtype=torch.long)
    return {
        "src_ids": src_ids,
        "tgt_ids": tgt_ids,
        "targets": targets,
        "src_padding_mask": src_padding_mask,
    }


class TranslationTask(Task):
    """Folio -> modern spelling over aligned speech pairs (data/parallel.py)."""

    name = "translation"
    baseline_name = "unigram entropy"

    def __init__(self, run: RunConfig, tokenizer=None) -> None:
        data = run.data
        pairs = parallel_corpus(data.align_threshold, data.max_pair_chars)
        by_split = {split: in_split(pairs, split) for split in SPLITS}
        train_texts = [text for p in by_split["train"] for text in (p.folio, p.modern)]
        self.tokenizer = tokenizer or train_translation_tokenizer(train_texts, data.bpe_vocab_size)
        self.ids = SpecialIds.of(self.tokenizer)
        # <s> + target must fit the decoder's positions, the source the encoder's.
        limit = run.model_config(self.tokenizer.vocab_size).max_seq_len - 1
        self.examples = {split: self._encode(by_split[split], limit) for split in SPLITS}
        if not self.examples["train"] or not self.examples["validation"]:
            raise ValueError(
                f"the parallel corpus gives {len(self.examples['train'])} training and "
                f"{len(self.examples['validation'])} validation pairs of at most {limit} "
                "tokens: raise model.max_seq_len or lower data.max_pair_chars"
            )
        self.baseline_loss = unigram_entropy(
            [[*tgt, self.ids.eos] for _, tgt in self.examples["train"]]
        )

    def _encode(self, pairs: list[ParallelPair], limit: int) -> list[tuple[list[int], list[int]]]:
        encoded = [(self.tokenizer.encode(p.folio), self.tokenizer.encode(p.modern)) for p in pairs]
        return [(s, t) for s, t in encoded if len(s) <= limit and len(t) <= limit]

    def model_config(self, run: RunConfig) -> ModelConfig:
        cfg = run.model_config(self.tokenizer.vocab_size)
        if cfg.family != "seq2seq":
            raise ConfigError(
                f'data.task="translation" needs model.family="seq2seq", not {cfg.family!r}'
            )
        return cfg.replace(
            bos_token_id=self.ids.bos, eos_token_id=self.ids.eos, pad_token_id=self.ids.pad
        )

    @property
    def n_train(self) -> int:
        return len(self.examples["train"])

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        picks = batch_indices(self.n_train, batch_size, step, seed).tolist()
        return collate([self.examples["train"][i] for i in picks], self.ids)

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        examples = self.examples["validation"]
        n = len(examples)
        picks = torch.linspace(0, n - 1, min(n, batch_size * n_batches)).round().long().tolist()
        for start in range(0, len(picks), batch_size):
            yield collate([examples[i] for i in picks[start : start + batch_size]], self.ids)

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Real tokens on both sides (padding left out)."""
        return int(batch["src_padding_mask"].sum()) + int((batch["targets"] != -100).sum())


# --- translating text and scoring it ----------------------------------------------------------


def translate(
    model,
    tokenizer,
    texts: Sequence[str],
    beam_size: int = 1,
    length_penalty: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    max_chars: int | None = None,
) -> list[str]:
    """Modernize each text: greedy decoding in batches (beam_size=1) or beam search one text
    at a time. max_chars: cut longer texts at spaces into pieces of about the length the model
    was trained on, translate the pieces and join them with spaces."""
    if max_chars is not None:
        pieces = [word_chunks(text, max_chars) for text in texts]
        flat = _translate_pieces(
            model,
            tokenizer,
            [piece for text_pieces in pieces for piece in text_pieces],
            beam_size,
            length_penalty,
            max_new_tokens,
            batch_size,
        )
        out, start = [], 0
        for text_pieces in pieces:
            out.append(" ".join(flat[start : start + len(text_pieces)]))
            start += len(text_pieces)
        return out
    return _translate_pieces(
        model, tokenizer, texts, beam_size, length_penalty, max_new_tokens, batch_size
    )


def word_chunks(text: str, max_chars: int) -> list[str]:
    """The text's words regrouped into pieces of at most max_chars (a longer word alone)."""
    pieces: list[str] = []
    for word in text.split():
        if pieces and len(pieces[-1]) + 1 + len(word) <= max_chars:
            pieces[-1] += " " + word
        else:
            pieces.append(word)
    return pieces or [""]


def _translate_pieces(
    model,
    tokenizer,
    texts: Sequence[str],
    beam_size: int,
    length_penalty: float,
    max_new_tokens: int | None,
    batch_size: int,
) -> list[str]:
    from glassformer.infer.seq2seq_decode import beam_search, greedy_decode

    ids = SpecialIds.of(tokenizer)
    limit = model.cfg.max_seq_len
    max_new = min(max_new_tokens or limit - 1, limit - 1)  # the start token takes one position
    sources = [tokenizer.encode(text)[:limit] for text in texts]
    outputs: list[list[int]] = []
    model.eval()
    if beam_size == 1:
        # Sorted by length so a batch pads little; the order is restored below.
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        decoded: dict[int, list[int]] = {}
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = collate([(sources[i], []) for i in chunk], ids)
            # Modern spelling is about as long as the Folio's: twice the source is plenty.
            steps = min(max_new, 2 * batch["src_ids"].shape[1] + 8)
            rows = greedy_decode(model, batch["src_ids"], batch["src_padding_mask"], steps, ids.eos)
            decoded.update(zip(chunk, rows, strict=True))
        outputs = [decoded[i] for i in range(len(sources))]
    else:
        for src in sources:
            src_ids = torch.tensor([src], dtype=torch.long)
            outputs.append(
                beam_search(
                    model,
                    src_ids,
                    beam_size=beam_size,
                    length_penalty=length_penalty,
                    max_new_tokens=min(max_new, 2 * len(src) + 8),
                    eos_token_id=ids.eos,
                )
            )
    return [tokenizer.decode([t for t in row if t != ids.eos]) for row in outputs]


@dataclass
class TranslationScores:
    n_pairs: int
    model_chrf: float
    model_bleu: float
    copy_chrf: float
    copy_bleu: float
    examples: list[tuple[str, str, str]]  # (source, reference, model output)


def score(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, float]:
    """(chrF, BLEU) of the hypotheses against one reference each, by sacrebleu."""
    import sacrebleu

    refs = [list(references)]
    return (
        sacrebleu.corpus_chrf(list(hypotheses), refs).score,
        sacrebleu.corpus_bleu(list(hypotheses), refs).score,
    )


def evaluate_translation(
    model,
    tokenizer,
    pairs: Sequence[ParallelPair],
    beam_size: int = 1,
    length_penalty: float = 1.0,
) -> TranslationScores:
    """chrF and BLEU of the model's modernizations of `pairs` and of copying the Folio text."""
    sources = [p.folio for p in pairs]
    references = [p.modern for p in pairs]
    outputs = translate(model, tokenizer, sources, beam_size, length_penalty)
    model_chrf, model_bleu = score(outputs, references)
    copy_chrf, copy_bleu = score(sources, references)
    return TranslationScores(
        n_pairs=len(pairs),
        model_chrf=model_chrf,
        model_bleu=model_bleu,
        copy_chrf=copy_chrf,
        copy_bleu=copy_bleu,
        examples=list(zip(sources, references, outputs, strict=True)),
    )


def evenly_spaced(items: Sequence, limit: int | None) -> list:
    """At most `limit` items spread evenly over the sequence (all when limit is None)."""
    if limit is None or limit >= len(items):
        return list(items)
    picks = torch.linspace(0, len(items) - 1, limit).round().long().tolist()
    return [items[i] for i in picks]


# --- loading a trained translator and its held-out plays --------------------------------------


def load_translator(path: str):
    """(model, tokenizer, data config) of a translation checkpoint (a run or step directory);
    the data config (pair length, alignment threshold) is the one it was trained with."""
    from glassformer.interop.checkpoint import CheckpointError, load
    from glassformer.train.checkpoint import read_train_state

    model, tokenizer = load(path)
    if model.cfg.family != "seq2seq" or tokenizer is None:
        raise ValueError(
            f"{path} holds a {model.cfg.family} model"
            + ("" if tokenizer else " without a tokenizer")
            + ": translate needs a seq2seq checkpoint trained with data.task='translation'"
        )
    SpecialIds.of(tokenizer)  # fail early on a tokenizer without <pad> <s> </s>
    try:
        state, _ = read_train_state(path)
        data = RunConfig.from_dict(state.get("run_config", {})).data
    except CheckpointError:  # weights only: assume the defaults
        data = RunConfig().data
    return model, tokenizer, data


def held_out_pairs(split: str, data=None) -> list[ParallelPair]:
    """The pairs of the validation or test plays, aligned as in training (`data`: DataConfig)."""
    if split not in ("validation", "test"):
        raise ValueError(f"split={split!r}: evaluate on 'test' or 'validation' (held-out plays)")
    data = data or RunConfig().data
    return in_split(parallel_corpus(data.align_threshold, data.max_pair_chars), split)


def format_scores(scores: TranslationScores, split: str, n_examples: int = 3) -> str:
    plays = ", ".join(TEST_PLAYS if split == "test" else VALIDATION_PLAYS)
    lines = [
        f"{scores.n_pairs} held-out pairs ({split}: {plays}), scored by sacrebleu",
        f"  {'':<22}{'chrF':>8}{'BLEU':>8}",
        f"  {'model':<22}{scores.model_chrf:>8.2f}{scores.model_bleu:>8.2f}",
        f"  {'copy the input':<22}{scores.copy_chrf:>8.2f}{scores.copy_bleu:>8.2f}",
    ]
    for source, reference, output in scores.examples[:n_examples]:
        lines += [f"\nfolio:     {source}", f"model:     {output}", f"reference: {reference}"]
    return "\n".join(lines)
