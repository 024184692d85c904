"""Fine-tuning a pretrained model (seed 002: "微调只是在现成基础上小幅调向"): its own chat data,
rendered by its own chat template, trained with LoRA adapters or on every weight, on the one
trainer of train/trainer.py (schedule, clipping, accumulation, bf16, atomic checkpoints, exact
resume).

Data is JSONL, one example a line: {"messages": [{"role": ..., "content": ...}, ...]} learns
only the assistant turns (the template's text and the other turns are context, target -100),
{"text": ...} learns every token. Which tokens an assistant turn owns is found by rendering:
the conversation up to the turn with the generation prompt ("<|im_start|>assistant\\n") is a
prefix of the conversation through the turn, and the tokens in between (its text and the
template's end-of-turn marker) are the targets.

A LoRA run's step folder holds the adapters only (model.safetensors: the trained tensors;
adapter_config.json + adapter_model.safetensors: the same in peft's format) beside the trainer
state, and the run folder a copy of the newest adapter, so `peft.PeftModel.from_pretrained`
reads `--out` directly. A full run saves whole glassformer checkpoints that from_pretrained
loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from glassformer import json_input
from glassformer.config import ConfigError
from glassformer.data import IGNORE_INDEX, batch_indices, lm_targets, pack
from glassformer.data.folio_chat import (  # noqa: F401  (re-exported: the task's names)
    FOLIO_INSTRUCTION,
    FOLIO_TRAIN_EXAMPLES,
    FOLIO_VAL_EXAMPLES,
    folio_chat,
    folio_chat_records,
    write_folio_jsonl,
)
from glassformer.interop.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    checkpoint_folders,
    read_checkpoint_tensors,
)
from glassformer.interop.integrity import clip
from glassformer.interop.peft import write_adapter_files
from glassformer.interop.pretrained import from_pretrained, resolve
from glassformer.nn.lora import apply_lora, trainable_fraction
from glassformer.tokenizers.span import chars_per_token_cap, longest_token_chars
from glassformer.train.checkpoint import publish_adapter
from glassformer.train.config import FOLIO_DATA, FinetuneConfig, FinetuneRunConfig
from glassformer.train.tasks import Task
from glassformer.train.trainer import ResumePoint, Trainer, TrainResult, evaluate


class FinetuneDataError(ValueError):
    """A data file a fine-tune cannot use; the message names the file, the line and the fix."""


# --- examples -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One tokenized example: ids (T,) and, per token, whether it is learned (a target)."""

    ids: list[int]
    learn: list[bool]
    line: int  # where it came from (1-based), for error messages


def assistant_token_mask(
    tokenizer: Any, messages: list[dict[str, Any]]
) -> tuple[list[int], list[bool]]:
    """The conversation's ids (the template's own rendering, no generation prompt) and True at
    every token of an assistant turn: its text and the template's end-of-turn tokens.

    Turn i owns the tokens between "everything before it + the generation prompt" and
    "everything through it". A template for which the first is not a prefix of the second (it
    rewrites earlier turns once a later one exists) cannot be split this way: ValueError."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
    learn = [False] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.encode_chat(messages[:turn], add_generation_prompt=True)
        through = tokenizer.encode_chat(messages[: turn + 1], add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise ValueError(
                f"the chat template renders the turns before assistant turn {turn} differently"
                " once that turn is added, so its tokens cannot be told apart: start the"
                ' conversation with a system or user message, or use {"text": ...} lines'
            )
        learn[len(before) : len(through)] = [True] * (len(through) - len(before))
    return ids, learn


def _bad_line(source: str, line: int, problem: str) -> FinetuneDataError:
    return FinetuneDataError(
        f"{source} line {line}: {problem}; each line must be one JSON object, either"
        ' {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content":'
        ' "..."}]} or {"text": "..."}'
    )


def check_record(record: Any, source: str, line: int) -> None:
    """Refuse a line that is not a chat or text example, naming the line and the fix."""
    if not isinstance(record, dict) or len({"messages", "text"} & set(record)) != 1:
        shown = clip(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise _bad_line(source, line, f"found {shown}, not exactly one of messages or text")
    if "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise _bad_line(source, line, f"text={clip(record['text'])} must be a non-empty string")
        return
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _bad_line(source, line, f"messages={clip(messages)} must be a non-empty list")
    for index, message in enumerate(messages):
        ok = isinstance(message, dict) and all(
            isinstance(message.get(key), str) for key in ("role", "content")
        )
        if not ok:
            raise _bad_line(
                source, line, f"message {index} is {clip(message)}, not a role and a content string"
            )
    if not any(message["role"] == "assistant" for message in messages):
        roles = ", ".join(message["role"][:20] for message in messages[:8])
        roles += ", ..." if len(messages) > 8 else ""
        raise FinetuneDataError(
            f"{source} line {line}: the conversation ({roles}) has no assistant turn, so there is"
            ' nothing to learn: add {"role": "assistant", "content": "..."} with the answer'
        )


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of a JSONL file, each checked."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FinetuneDataError(
            f"no data file at {path}: give a .jsonl file of chat or text examples"
        ) from None
    except UnicodeDecodeError as err:
        raise FinetuneDataError(
            f"{path} is not UTF-8 text ({err.reason}): save it as UTF-8"
        ) from None
    records = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json_input.loads(raw)  # nesting too deep or numbers too long: bad JSON too
        except json.JSONDecodeError as err:
            problem = f"not valid JSON ({err.msg} at column {err.colno})"
            raise _bad_line(str(path), number, problem) from None
        check_record(record, str(path), number)
        records.append((number, record))
    if not records:
        raise FinetuneDataError(
            f"{path} holds no examples (it is empty or blank): write one JSON object per line"
        )
    return records


def encode_records(
    tokenizer: Any, records: Sequence[tuple[int, dict[str, Any]]], max_len: int, source: str
) -> list[Example]:
    """Tokenize checked records; an example longer than max_len tokens is an error that says
    what to do (the trainer never cuts an answer off silently)."""
    eos = tokenizer.eos_token_id
    longest = longest_token_chars(tokenizer) if records else None
    cap = chars_per_token_cap(tokenizer) if records and longest is None else None
    examples = []
    for line, record in records:
        # An example that cannot fit is refused before it is tokenized (50 MB of text takes a
        # minute): no token stands for more than `longest` characters, and a chat template
        # writes every message's content out. A tokenizer that drops text has no such bound;
        # it gets a cap on how sparse an example may be (chars_per_token_cap).
        texts = (
            [m["content"] for m in record["messages"]] if "messages" in record else [record["text"]]
        )
        chars = sum(map(len, texts))
        if longest is not None and chars > max_len * longest:
            raise FinetuneDataError(
                f"{source} line {line} holds {chars:,} characters, so at least "
                f"{-(-chars // longest):,} tokens (no token of this tokenizer is longer than "
                f"{longest} character{'s' * (longest > 1)}), more than finetune.max_seq_len="
                f"{max_len}: split or shorten the example, or raise --max-seq-len"
            )
        if cap is not None and chars > max_len * cap:
            raise FinetuneDataError(
                f"{source} line {line} holds {chars:,} characters, more than {cap} for each of"
                f" finetune.max_seq_len={max_len} tokens: this tokenizer drops text (spaces,"
                " unknown words), so only tokenizing it all would count its tokens, and an"
                f" example sparser than {cap} characters a token is mostly text the model never"
                " sees; split or shorten the example, or raise --max-seq-len"
            )
        if "messages" in record:
            if not getattr(tokenizer, "chat_template", None):
                raise FinetuneDataError(
                    f"{source} line {line} is a conversation, but the model's tokenizer has no"
                    ' chat template to render it: use {"text": ...} lines, or a chat model'
                )
            try:
                ids, learn = assistant_token_mask(tokenizer, record["messages"])
            except ValueError as err:
                raise FinetuneDataError(f"{source} line {line}: {err}") from None
        else:
            text = record["text"]
            # Plain text learns every token and, with an EOS id, where the text ends.
            ids = tokenizer.encode(text, add_special_tokens=False)
            ids += [eos] if eos is not None else []
            learn = [True] * len(ids)
        if len(ids) > max_len:
            raise FinetuneDataError(
                f"{source} line {line} is {len(ids)} tokens, more than finetune.max_seq_len="
                f"{max_len}: raise --max-seq-len to at least {len(ids)}, or split or shorten the"
                " example"
            )
        if len(ids) < 2 or not any(learn[1:]):
            raise FinetuneDataError(
                f"{source} line {line} has no token to predict: give it an answer (or text)"
            )
        examples.append(Example(ids, learn, line))
    return examples


# --- batches --------------------------------------------------------------------------------------


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows: input_ids (B, T) and targets (B, T), the next id where it is learned
    and -100 elsewhere. Padding follows the text, so causal attention never reads it."""
    T = max(len(ex.ids) for ex in examples) - 1
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    for row, ex in enumerate(examples):
        ids = torch.tensor(ex.ids, dtype=torch.long)
        learned = torch.tensor(ex.learn[1:], dtype=torch.bool)
        input_ids[row, : len(ids) - 1] = ids[:-1]
        targets[row, : len(ids) - 1] = torch.where(learned, ids[1:], IGNORE_INDEX)
    return {"input_ids": input_ids, "targets": targets}


@dataclass
class PackedRows:
    """Examples packed into rows of max_len tokens (data/chunking.pack), with document and
    position ids so that no token attends across examples."""

    tokens: torch.Tensor  # (N, L)
    learn: torch.Tensor  # (N, L) bool
    document_ids: torch.Tensor  # (N, L), -1 at padding
    position_ids: torch.Tensor  # (N, L)

    @classmethod
    def of(cls, examples: Sequence[Example], max_len: int, pad_id: int) -> PackedRows:
        blocks = pack([ex.ids for ex in examples], max_len, pad_id=pad_id)
        masks = pack([[int(b) for b in ex.learn] for ex in examples], max_len, pad_id=0)

        def rows(lists: list[list[int]]) -> torch.Tensor:
            return torch.tensor(lists, dtype=torch.long)

        return cls(
            tokens=rows([b.input_ids for b in blocks]),
            learn=rows([m.input_ids for m in masks]).bool(),
            document_ids=rows([b.document_ids for b in blocks]),
            position_ids=rows([b.position_ids for b in blocks]),
        )

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens, documents = self.tokens[indices], self.document_ids[indices]
        targets = lm_targets(tokens, documents)  # -100 across examples and at padding
        targets[~self.learn[indices][:, 1:]] = IGNORE_INDEX
        return {
            "input_ids": tokens[:, :-1],
            "targets": targets,
            "document_ids": documents[:, :-1],
            "position_ids": self.position_ids[indices][:, :-1],
        }


class FinetuneTask(Task):
    """The trainer's view of fine-tuning data: batches a pure function of (seed, step)."""

    name = "finetune"
    baseline_name = "before fine-tuning"

    def __init__(
        self, train: list[Example], val: list[Example], tokenizer: Any, pad_id: int, pack_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.train_examples, self.val_examples = train, val
        self.pad_id = pad_id
        self.packed = PackedRows.of(train, pack_len, pad_id) if pack_len else None
        self.baseline_loss = float("nan")  # the model's validation loss, set before training

    @property
    def n_train(self) -> int:
        return len(self.train_examples)

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        if self.packed is not None:
            return self.packed.batch(batch_indices(len(self.packed), batch_size, step, seed))
        picks = batch_indices(self.n_train, batch_size, step, seed)
        return collate([self.train_examples[i] for i in picks.tolist()], self.pad_id)

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.val_examples)
        picks = torch.linspace(0, n - 1, min(n, batch_size * n_batches)).round().long()
        for chunk in picks.split(batch_size):
            yield collate([self.val_examples[i] for i in chunk.tolist()], self.pad_id)


def load_examples(
    ft: FinetuneConfig, tokenizer: Any, max_len: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """(training, validation) examples of a fine-tune's [finetune] data."""
    if ft.data == FOLIO_DATA:
        train = folio_chat_records("train", ft.folio_max_chars, FOLIO_TRAIN_EXAMPLES, seed)
        val = folio_chat_records("validation", ft.folio_max_chars, FOLIO_VAL_EXAMPLES, 0)
        train_records = list(enumerate(train, start=1))
        val_records = list(enumerate(val, start=1))
        return (
            encode_records(tokenizer, train_records, max_len, "folio (train plays)"),
            encode_records(tokenizer, val_records, max_len, "folio (validation play)"),
        )
    train = encode_records(tokenizer, read_jsonl(ft.data), max_len, ft.data)
    if ft.val_data is not None:
        return train, encode_records(tokenizer, read_jsonl(ft.val_data), max_len, ft.val_data)
    n_val = max(1, round(ft.val_fraction * len(train)))
    if len(train) - n_val < 1:
        raise FinetuneDataError(
            f"{ft.data} holds {len(train)} example(s): too few to hold out validation examples"
            " and still train; add examples or give --val-data FILE.jsonl"
        )
    return train[:-n_val], train[-n_val:]


# --- the run --------------------------------------------------------------------------------------


DEFAULT_MAX_SEQ_LEN = 512


def pad_token_id(tokenizer: Any) -> int:
    """The id padding rows are filled with: the tokenizer's pad token, else its end of text."""
    pad_id = tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
    return pad_id or 0


def example_length(ft: FinetuneConfig, model_positions: int) -> int:
    """The longest example allowed: finetune.max_seq_len, or 512 within the model's limit."""
    if ft.max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, model_positions)
    if ft.max_seq_len > model_positions:
        raise ConfigError(
            f"finetune.max_seq_len={ft.max_seq_len} is more than the model's {model_positions}"
            f" positions: lower --max-seq-len to at most {model_positions}"
        )
    return ft.max_seq_len


class FinetuneTrainer(Trainer):
    """The trainer, building its model from a pretrained one and, with LoRA, saving adapters."""

    run: FinetuneRunConfig
    out_flag = "--out"

    @property
    def holds(self) -> str:
        return "adapter" if self.run.finetune.method == "lora" else "model"

    def _sources(self) -> list[Path]:
        ft = self.run.finetune
        sources = checkpoint_folders(resolve(ft.model))
        data = [Path(name) for name in (ft.data, ft.val_data) if name and Path(name).exists()]
        return [*sources, *data]

    def _check_before_start(self) -> None:
        # The model's size is known once it is loaded; loading checks the memory.
        if self.parallel.sharded:
            raise ConfigError(
                "train.strategy='fsdp' is for `glassformer train`; a fine-tune saves adapters or"
                " a pretrained model's own files from one whole copy: use train.strategy=ddp"
            )

    def _build(self, start: ResumePoint | None) -> None:
        ft = self.run.finetune
        model, tokenizer = from_pretrained(ft.model, quantize=ft.quantize)
        if tokenizer is None:
            raise ConfigError(
                f"finetune.model={ft.model!r} has no tokenizer.json, so its data cannot be"
                " tokenized: use a model folder or GGUF file that ships its tokenizer"
            )
        if model.cfg.family not in ("gpt",):
            raise ConfigError(
                f"finetune.model={ft.model!r} is a {model.cfg.family!r} model: fine-tuning here"
                " trains decoder-only language models (family 'gpt': Llama, SmolLM2, GPT-2, ...)"
            )
        max_len = example_length(ft, model.cfg.max_seq_len)
        self.tokenizer, self.model_cfg = tokenizer, model.cfg
        train, val = load_examples(ft, tokenizer, max_len, self.cfg.seed)
        self.task = FinetuneTask(
            train, val, tokenizer, pad_token_id(tokenizer), max_len * ft.packing
        )
        if ft.method == "lora":
            self.lora_sites = apply_lora(
                model, ft.lora_targets, ft.lora_rank, ft.lora_alpha, ft.lora_dropout
            )
        else:
            model.requires_grad_(True)
        self.model = model.to(self.device)
        self.model.eval()
        self.task.baseline_loss = evaluate(
            self.model, self.task, self.cfg.batch_size, self.cfg.eval_batches, self.half
        )

    def _check_resumable(self, step_dir: Path, state: dict[str, Any]) -> None:
        super()._check_resumable(step_dir, state)
        saved = (state.get("run_config") or {}).get("finetune")
        now = dataclasses.asdict(self.run.finetune)
        if not isinstance(saved, dict):
            return
        changes = [
            f"finetune.{key} ({saved.get(key)!r} -> {now[key]!r})"
            for key in sorted(now)
            if saved.get(key) != now[key]
        ]
        if changes:
            raise ConfigError(
                f"--resume cannot change [finetune] of the run in {self.out_dir}:"
                f" {'; '.join(changes)}; resume with the run's own values (only [train] may"
                " change, e.g. max_steps), or start a new run with --overwrite or another --out"
            )

    # LoRA: a step holds the trained tensors only; the frozen base comes from finetune.model.

    def _trained_tensors(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def _write_model_files(self, directory: Path) -> None:
        if self.run.finetune.method == "full":
            return super()._write_model_files(directory)
        tensors = {n: t.to("cpu").contiguous() for n, t in self._trained_tensors().items()}
        metadata = {"format": "pt", "glassformer.base_model": self.run.finetune.model}
        safetensors.torch.save_file(tensors, str(directory / MODEL_FILE), metadata=metadata)
        (directory / CONFIG_FILE).write_text(self.model_cfg.to_json() + "\n")
        write_adapter_files(self.model, directory, base_model=self.run.finetune.model)

    def _load_weights(self, step_dir: Path) -> None:
        if self.run.finetune.method == "full":
            return super()._load_weights(step_dir)
        on_disk = read_checkpoint_tensors(step_dir / MODEL_FILE)
        trained = self._trained_tensors()
        if set(on_disk) != set(trained) or any(
            on_disk[n].shape != t.shape for n, t in trained.items()
        ):
            missing = sorted(set(trained) - set(on_disk))
            extra = sorted(set(on_disk) - set(trained))
            raise ConfigError(
                f"{step_dir / MODEL_FILE} does not hold this run's adapters (missing:"
                f" {missing[:3]}, not in the model: {extra[:3]}): resume with the run's own"
                " [finetune] values, or start over with --overwrite"
            )
        with torch.no_grad():
            for name, tensor in trained.items():
                tensor.copy_(on_disk[name])

    def save(self) -> Path:
        step_dir = super().save()
        if self.run.finetune.method == "lora" and self.parallel.is_main:
            publish_adapter(step_dir, self.out_dir)  # the newest adapter, where peft looks
        return step_dir

    @property
    def trainable_fraction(self) -> float:
        if self.run.finetune.method == "lora":
            return trainable_fraction(self.model)
        return 1.0


def finetune(
    run: FinetuneRunConfig, resume: bool = False, progress: bool = True, overwrite: bool = False
) -> TrainResult:
    """Fine-tune (or resume fine-tuning) the run described by `run` and return its losses."""
    trainer = FinetuneTrainer(run, resume=resume, progress=progress, overwrite=overwrite)
    return trainer.fit()
