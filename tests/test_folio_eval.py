"""The Folio task's scoring (train/folio_eval.py): prompts exactly as transformers renders the
chat template, the engine's batched greedy decoding equal to a plain greedy loop over the
model, few-shot examples from the training plays only, and sacrebleu's closed-form ends."""

from __future__ import annotations

import pytest
import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer

from glassformer.chat import end_of_turn_ids
from glassformer.config import ModelConfig
from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
from glassformer.interop.pretrained import resolve
from glassformer.models import build_model
from glassformer.train.finetune import folio_chat
from glassformer.train.folio_eval import (
    chat_prompts,
    held_out_speeches,
    modernise,
    score_outputs,
    shot_messages,
)
from glassformer.train.translation import corpus_split

FOLIOS = ["Long liue the King", "Good morrow, Cozen.", "When shall we three meet againe?"]


@pytest.fixture(scope="module")
def smol():
    return tokenizer_from_gguf(read_gguf(resolve("smollm2")))


def test_prompts_are_the_chat_template_ready_for_the_reply(smol):
    shots = shot_messages(2)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(smol.hf.to_str())
    )
    for folio, prompt in zip(FOLIOS, chat_prompts(smol, FOLIOS, shots), strict=True):
        expected = reference.apply_chat_template(
            shots + folio_chat(folio)["messages"],
            chat_template=smol.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert prompt == list(expected)
        assert smol.decode(prompt).endswith(f"{folio}<|im_end|>\n<|im_start|>assistant\n")


def test_modernise_is_a_plain_greedy_loop(smol):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=smol.vocab_size, d_model=32, n_layers=2, n_heads=2,
                      max_seq_len=256, position="rope")  # fmt: skip
    model = build_model(cfg).eval()
    n_new = 6
    got = modernise(model, smol, FOLIOS, max_new_tokens=n_new, rows=2)  # 3 prompts, 2 slots
    stops = end_of_turn_ids(smol)
    expected = []
    for prompt in chat_prompts(smol, FOLIOS):
        ids, new = list(prompt), []
        with torch.no_grad():
            for _ in range(n_new):
                token = int(model(torch.tensor([ids]))[0, -1].argmax())
                if token in stops:
                    break
                ids.append(token)
                new.append(token)
        expected.append(smol.decode(new).strip())
    assert got == expected


def test_few_shot_examples_come_from_the_training_plays():
    shots = shot_messages(5)
    assert shots == shot_messages(5)  # the same examples every run
    assert [m["role"] for m in shots] == ["user", "assistant"] * 5
    train = {(p.folio, p.modern) for p in corpus_split("train", max_chars=120)}
    held_out = {p.folio for p in corpus_split("test", max_chars=120)}
    held_out |= {p.folio for p in corpus_split("validation", max_chars=120)}
    for user, assistant in zip(shots[::2], shots[1::2], strict=True):
        folio = user["content"].rsplit("\n\n", 1)[1]
        assert (folio, assistant["content"]) in train
        assert folio not in held_out


def test_scores_reach_the_closed_form_ends():
    pairs = held_out_speeches(20)
    assert len(pairs) == 20 and len({p.play for p in pairs}) == 1  # one held-out play
    perfect = score_outputs([p.modern for p in pairs], pairs)
    assert perfect.chrf == pytest.approx(100.0) and perfect.bleu == pytest.approx(100.0)
    nothing = score_outputs([""] * len(pairs), pairs)
    assert nothing.chrf == 0.0 and nothing.bleu == 0.0
