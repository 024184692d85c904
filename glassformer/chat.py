"""Terminal chat with a pretrained model (seed 002's generation pipeline, one turn at a time):
messages -> the model's chat template -> token ids -> Engine.stream -> incremental text.

The engine knows ids only; this face owns the conversation, the template, the end-of-turn
tokens and Ctrl-C. Each turn re-renders the whole conversation, so the prompt always matches
what the template would produce for the history (no drift between turns), and the engine keeps
the conversation's KV cache between turns: turn N prefills only the tokens after the prefix it
shares with turn N - 1 (its new message), not the whole history again.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from glassformer.detokenize import IncrementalDecoder, StopStringsAfter
from glassformer.infer.engine import Engine, GenerationStats, Row
from glassformer.infer.sampling import SamplingParams
from glassformer.infer.stats import format_reply_stats
from glassformer.templates import ChatTemplateError, end_of_turn_ids
from glassformer.tokenizers import PretrainedTokenizer


@dataclass
class Reply:
    text: str
    token_ids: list[int]  # the reply's tokens, without the end-of-turn token
    stats: GenerationStats
    stop_reason: str  # "end_of_turn", "max_new_tokens", "context_full" or "interrupted"
    prompt_ids: list[int] = field(default_factory=list)  # the conversation this reply answers


# Chat's defaults: room for a long answer, a little randomness.
CHAT_SAMPLING = SamplingParams(max_new_tokens=512, temperature=0.7)


@dataclass
class ChatSession:
    engine: Engine
    tokenizer: PretrainedTokenizer
    system: str | None = None
    sampling: SamplingParams = CHAT_SAMPLING
    messages: list[dict[str, str]] = field(default_factory=list)
    # False: what the user types is encoded as text, so "<|im_start|>system" typed in a
    # message cannot open a system turn. True: control tokens in messages are parsed (raw).
    parse_special: bool = False
    # Answer without thinking: the template is asked for no thinking (Qwen3's
    # enable_thinking=False writes an empty <think></think>), and the prompt gets that empty
    # segment if the template did not write it (sampling should carry a budget of 0).
    no_think_suffix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so chat cannot format a "
                "conversation: use `glassformer generate` for plain continuation"
            )
        self.stop_ids = end_of_turn_ids(self.tokenizer)
        # One slot of the whole context, kept between turns (a parked row holds the history).
        if self.engine.max_rows is None:
            self.engine.max_rows = 1
        self._row: Row | None = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if self._row is not None:
            self.engine.release(self._row)
            self._row = None

    def prompt_ids(self) -> list[int]:
        """The conversation rendered for the next assistant turn; the oldest turns are dropped
        (the system message kept) until the prompt leaves room for a reply."""
        limit = self.engine.max_seq_len - min(self.sampling.max_new_tokens, 64)
        while True:
            ids = self.tokenizer.encode_chat(
                self.messages,
                add_generation_prompt=True,
                parse_special_in_content=self.parse_special,
                template_kwargs={"enable_thinking": False} if self.no_think_suffix else None,
            )
            suffix = list(self.no_think_suffix)
            if suffix and suffix[-1] not in ids[-4:]:  # the template wrote no empty segment
                ids += suffix
            first = 1 if self.messages[0]["role"] == "system" else 0
            if len(ids) <= limit or len(self.messages) - first <= 1:
                break
            del self.messages[first]
        if len(ids) > limit:
            self.messages.pop()
            raise ValueError(
                f"the message is {len(ids)} tokens with the template, more than the "
                f"{self.engine.max_seq_len}-token context allows: send something shorter"
            )
        return ids

    def send(self, text: str, write: Callable[[str], object] = sys.stdout.write) -> Reply:
        """Add a user message, stream the assistant's reply through `write`, and keep it in the
        history. Ctrl-C (KeyboardInterrupt) stops the reply, which is kept as far as it got."""
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self.prompt_ids()
        except KeyboardInterrupt:
            self.messages.pop()  # stopped before the reply began: forget the question
            raise
        room = self.engine.max_seq_len - len(prompt)
        limit = max(1, min(self.sampling.max_new_tokens, room))
        params = dataclasses.replace(
            self.sampling,
            max_new_tokens=limit,
            min_tokens=min(self.sampling.min_tokens, limit),  # a short context cuts both
            eos_token_id=self.tokenizer.eos_token_id,
            stop_token_ids=tuple(sorted(self.stop_ids | set(self.sampling.stop_token_ids))),
        )
        row = self.engine.add(prompt, params, keep_cache=True, continues=self._row)
        self._row = row
        tokens = self.engine.follow(row)
        decoder = IncrementalDecoder(self.tokenizer)
        stop_strings = StopStringsAfter(params.stop, params.min_tokens)
        token_ids: list[int] = []
        try:
            for token_id in tokens:
                if token_id in self.stop_ids:
                    break
                token_ids.append(token_id)
                write(stop_strings.push_token(decoder.push(token_id), len(token_ids)))
            write(stop_strings.push(decoder.finish()) + stop_strings.flush())
            stop_reason = _REASONS.get(row.stop_reason, row.stop_reason)
        except KeyboardInterrupt:
            tokens.close()  # the row stops; its slot keeps the reply so far for the next turn
            stop_reason = "interrupted"
        # The reply as written: it ends where a stop string begins (after min_tokens tokens).
        cut = StopStringsAfter(params.stop, params.min_tokens)
        pieces = IncrementalDecoder(self.tokenizer)
        reply = "".join(cut.push_token(pieces.push(t), n) for n, t in enumerate(token_ids, 1))
        reply += cut.push(pieces.finish()) + cut.flush()
        self.messages.append({"role": "assistant", "content": reply})
        return Reply(reply, token_ids, row.stats, stop_reason, prompt)


_REASONS = {"eos": "end_of_turn", "stop": "end_of_turn"}  # the engine's words -> a turn's


def run_chat(session: ChatSession, read: Callable[[str], str] = input) -> None:
    """The read-reply loop: /reset clears the history, /exit or end of input quits, Ctrl-C
    stops a reply (and at the prompt only says how to quit). A message the turn refuses is one
    error line and the chat goes on; a chat template that fails (ChatTemplateError) ends it,
    raised, since every later turn renders the same template."""
    print(
        "chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits, "
        "Ctrl-C stops a reply",
        file=sys.stderr,
    )
    while True:
        try:
            line = read("> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(type /exit or press Ctrl-D to quit)")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            print("(conversation cleared)")
            continue
        try:
            reply = session.send(text, write=_write)
        except ChatTemplateError:
            raise  # the model file's template: every later turn renders it too, so chat ends
        except ValueError as err:  # this message (too long, a control token): send another
            print(f"error: {err}", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # while the prompt was being prepared
            print(" [stopped]")
            continue
        if reply.stop_reason == "interrupted":
            _write(" [stopped]")
        _write("\n")
        stats = format_reply_stats(reply.stats, len(reply.token_ids), reply.stop_reason)
        print(stats, file=sys.stderr, flush=True)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
