"""glassformer finetune (train/finetune.py): the assistant-token mask against transformers' own,
bad data as one clear error, packing equal to padding, and LoRA / full runs end to end on a tiny
random Llama with SmolLM2's tokenizer and chat template (adapters peft reads, exact resume)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from glassformer.cli import finetune as finetune_cli
from glassformer.config import ConfigError
from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
from glassformer.interop.integrity import InteropError
from glassformer.interop.pretrained import from_pretrained, resolve
from glassformer.models import build_model
from glassformer.train.config import FinetuneConfig, load_finetune_config
from glassformer.train.finetune import (
    Example,
    FinetuneDataError,
    PackedRows,
    assistant_token_mask,
    collate,
    encode_records,
    folio_chat,
    read_jsonl,
)

CONVERSATION = [
    {"role": "system", "content": "You modernise spelling."},
    {"role": "user", "content": "Long liue the King"},
    {"role": "assistant", "content": "Long live the King"},
    {"role": "user", "content": "Good morrow, Cozen."},
    {"role": "assistant", "content": "Good morrow, cousin."},
]
# SmolLM2's template with the assistant turns in {% generation %} blocks, which transformers
# reads to return its own assistant-token mask.
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endgeneration %}{% else %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smol():
    return tokenizer_from_gguf(read_gguf(resolve("smollm2")))


@pytest.fixture(scope="module")
def tiny_llama(smol, tmp_path_factory) -> Path:
    """A random 2-layer Llama folder (safetensors) with SmolLM2's tokenizer and template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=smol.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    smol.save(folder)
    return folder


def chat(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Modernise: Long liue {i}"},
            {"role": "assistant", "content": f"Long live {i}"},
        ]
    }


@pytest.fixture
def tiny_data(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    lines = [chat(i) for i in range(7)] + [{"text": "Good morrow, cousin."}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


# --- the mask ------------------------------------------------------------------------------------


def test_assistant_mask_equals_transformers_generation_mask(smol):
    ids, learn = assistant_token_mask(smol, CONVERSATION)
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(smol.hf.to_str())
    )
    out = reference.apply_chat_template(
        CONVERSATION,
        chat_template=GENERATION_TEMPLATE,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert ids == out["input_ids"]
    assert learn == [bool(m) for m in out["assistant_masks"]]  # token by token
    learned = smol.decode([t for t, keep in zip(ids, learn, strict=True) if keep])
    assert learned == "Long live the King<|im_end|>\nGood morrow, cousin.<|im_end|>\n"


def test_collated_targets_are_the_next_assistant_tokens_only(smol):
    ids, learn = assistant_token_mask(smol, CONVERSATION)
    short = Example([5, 6, 7], [False, True, True], line=2)
    batch = collate([Example(ids, learn, line=1), short], pad_id=0)
    targets = batch["targets"]
    assert batch["input_ids"].shape == targets.shape == (2, len(ids) - 1)
    for t in range(len(ids) - 1):  # position t predicts token t + 1 when that token is learned
        assert targets[0, t].item() == (ids[t + 1] if learn[t + 1] else -100)
    assert targets[1].tolist() == [6, 7] + [-100] * (len(ids) - 3)  # padding learns nothing


def test_text_lines_learn_every_token_and_the_end(smol, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text('\n{"text": "Good morrow."}\n\n')
    [example] = encode_records(smol, read_jsonl(path), 64, str(path))
    assert example.line == 2
    words = smol.encode("Good morrow.", add_special_tokens=False)
    assert example.ids == [*words, smol.eos_token_id]
    assert all(example.learn)


# --- bad data ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "a"}', "{not json"], r"line 2: not valid JSON"),
        (['{"messages": [{"role": "user", "content": "hi"}]}'], r"line 1: .*no assistant turn"),
        (["", "  "], r"holds no examples"),
        (['{"text": "a", "messages": []}'], r"line 1: .*not exactly one of messages or text"),
        (['{"messages": [{"role": "user"}]}'], r"line 1: message 0 .*role and a content"),
        (['{"text": ""}'], r"line 1: text='' must be a non-empty string"),
    ],
)
def test_bad_lines_name_the_line_and_the_fix(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FinetuneDataError, match=message) as caught:
        read_jsonl(path)
    assert str(path) in str(caught.value)


def test_too_long_example_says_how_long_and_what_to_raise(smol, tmp_path):
    path = tmp_path / "long.jsonl"
    text = "word " * 60
    path.write_text(json.dumps(chat(1)) + "\n" + json.dumps({"text": text}) + "\n")
    n = len(smol.encode(text, add_special_tokens=False)) + 1  # + EOS
    assert n > 50 > len(assistant_token_mask(smol, chat(1)["messages"])[0])
    with pytest.raises(FinetuneDataError, match=rf"line 2 is {n} tokens, .*--max-seq-len to at"):
        encode_records(smol, read_jsonl(path), 50, str(path))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"data": "x.jsonl", "lora_rank": 0}, r"lora_rank=0 must be >= 1"),
        ({"data": "x.jsonl", "method": "full", "quantize": "int8"}, r"use method='lora'"),
        ({"data": ""}, r"finetune.data is empty"),
        ({"data": "x.jsonl", "method": "qlora"}, r"pick one of lora, full"),
    ],
)
def test_bad_finetune_settings_are_one_error(values, message):
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig(**values)


# --- packing ------------------------------------------------------------------------------------


def test_packed_rows_give_the_loss_of_padded_rows(smol):
    examples = [Example(*assistant_token_mask(smol, chat(i)["messages"]), line=i) for i in range(3)]
    longest = max(len(ex.ids) for ex in examples)
    packed = PackedRows.of(examples, max_len=3 * longest, pad_id=0)
    assert len(packed) == 1  # all three share one row, kept apart by document ids
    from glassformer.config import ModelConfig

    cfg = ModelConfig(vocab_size=smol.vocab_size, d_model=16, n_layers=2, n_heads=2,
                      max_seq_len=256, position="rope", norm="rms", ffn="swiglu")  # fmt: skip
    model = build_model(cfg).eval()
    with torch.no_grad():
        padded = model.loss(**collate(examples, pad_id=0)).loss
        packed_loss = model.loss(**packed.batch(torch.tensor([0]))).loss
    torch.testing.assert_close(packed_loss, padded, rtol=1e-5, atol=1e-5)


# --- runs end to end ----------------------------------------------------------------------------


def run_cli(*argv: str) -> None:
    parser = argparse.ArgumentParser()
    finetune_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["finetune", *argv, "--no-progress", "--threads", "1"])
    args.func(args)


def small_run(model: Path, data: Path, out: Path, *extra: str) -> None:
    run_cli("--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--warmup", "1", "--lr", "1e-2", "--eval-interval", "100", *extra)  # fmt: skip


def test_lora_run_trains_only_adapters_and_peft_reads_them(tiny_llama, tiny_data, tmp_path):
    out = tmp_path / "lora"
    small_run(tiny_llama, tiny_data, out, "--method", "lora", "--steps", "3")
    step = out / "step-000003"
    base, _ = from_pretrained(tiny_llama)
    trained = load_file(str(step / "model.safetensors"))
    assert trained and all(".lora_" in name for name in trained)  # adapters only
    assert any(t.abs().sum() > 0 for n, t in trained.items() if "lora_B" in n)  # B moved
    assert (out / "adapter_config.json").is_file()  # the newest adapter, where peft looks
    # peft on transformers with the run's adapter == glassformer's base + the same adapter
    from glassformer.interop.peft import load_adapter

    load_adapter(base, out)  # into a model in eval mode: its adapters drop nothing either
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).eval()
    import peft

    with_adapter = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    ids = torch.tensor([[1, 520, 9531, 198, 31041, 2, 198]])
    with torch.no_grad():
        torch.testing.assert_close(base(ids), with_adapter(ids).logits, rtol=1e-4, atol=1e-4)


def test_full_run_saves_a_model_from_pretrained_loads(tiny_llama, tiny_data, tmp_path):
    out = tmp_path / "full"
    small_run(tiny_llama, tiny_data, out, "--method", "full", "--steps", "3")
    base, _ = from_pretrained(tiny_llama)
    tuned, tokenizer = from_pretrained(out)
    _, base_tokenizer = from_pretrained(tiny_llama)
    chat = [{"role": "user", "content": "hi"}]
    # the model's own tokenizer comes back: chat template and eos, not a bare BPE
    assert tokenizer.encode_chat(chat) == base_tokenizer.encode_chat(chat)
    assert tokenizer.eos_token_id == base_tokenizer.eos_token_id is not None
    changed = [
        name
        for name, p in tuned.state_dict().items()
        if not torch.equal(p, base.state_dict()[name])
    ]
    assert "tok_emb.weight" in changed and any("blocks.1." in n for n in changed)


def test_an_adapter_folder_is_not_taken_for_a_model(tiny_llama, tiny_data, tmp_path):
    out = tmp_path / "lora"
    small_run(tiny_llama, tiny_data, out, "--method", "lora", "--steps", "1")
    with pytest.raises(InteropError, match=r"holds a LoRA adapter, not a model.*--adapter"):
        from_pretrained(out)


def test_lora_resume_repeats_the_uninterrupted_run(tiny_llama, tiny_data, tmp_path):
    common = ("--method", "lora", "--lora-dropout", "0.1", "--lora-targets", "all-linear")
    small_run(tiny_llama, tiny_data, tmp_path / "straight", *common, "--steps", "4")
    small_run(tiny_llama, tiny_data, tmp_path / "split", *common, "--steps", "2")
    small_run(tiny_llama, tiny_data, tmp_path / "split", *common, "--steps", "4", "--resume")
    straight = load_file(str(tmp_path / "straight" / "step-000004" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "split" / "step-000004" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_resume_refuses_other_finetune_settings(tiny_llama, tiny_data, tmp_path):
    small_run(tiny_llama, tiny_data, tmp_path / "run", "--steps", "1")
    with pytest.raises(ConfigError, match=r"finetune.lora_rank \(8 -> 4\)"):
        small_run(tiny_llama, tiny_data, tmp_path / "run", "--steps", "2", "--resume",
                  "--lora-rank", "4")  # fmt: skip


def test_lora_on_an_int8_base_trains(tiny_llama, tiny_data, tmp_path):
    out = tmp_path / "int8"
    small_run(tiny_llama, tiny_data, out, "--quantize", "int8", "--steps", "2")
    trained = load_file(str(out / "step-000002" / "model.safetensors"))
    assert any(t.abs().sum() > 0 for n, t in trained.items() if "lora_B" in n)


def test_targets_that_match_nothing_list_what_exists(tiny_llama, tiny_data, tmp_path):
    with pytest.raises(ValueError, match=r"qq_proj"):
        small_run(tiny_llama, tiny_data, tmp_path / "x", "--lora-targets", "qq_proj")


# --- config and the Folio task -----------------------------------------------------------------


def test_flags_win_over_the_config_file_and_set(tmp_path):
    path = tmp_path / "ft.toml"
    path.write_text('[finetune]\ndata = "a.jsonl"\nlora_rank = 4\n[train]\nmax_steps = 7\n')
    run = load_finetune_config(
        path, ["finetune.lora_rank=16", "train.max_steps=9"], {"train": {"max_steps": 11}}
    )
    assert (run.finetune.lora_rank, run.train.max_steps) == (16, 11)


def test_the_repository_config_is_valid():
    run = load_finetune_config(Path(__file__).parents[1] / "configs/smollm2-lora-folio.toml")
    assert (run.finetune.data, run.finetune.method, run.finetune.model) == (
        "folio",
        "lora",
        "smollm2",
    )


def test_folio_instruction_renders_with_the_answer_learned(smol):
    record = folio_chat("Long liue the King", "Long live the King")
    ids, learn = assistant_token_mask(smol, record["messages"])
    learned = smol.decode([t for t, keep in zip(ids, learn, strict=True) if keep])
    assert learned == "Long live the King<|im_end|>\n"
    assert "First Folio" in smol.decode([t for t, keep in zip(ids, learn, strict=True) if not keep])
