"""Terminal chat with a pretrained model (seed 002's generation pipeline, one turn at a time):
messages -> the model's chat template -> token ids -> Engine.stream -> incremental text.

The engine knows ids only; this face owns the conversation, the template, the end-of-turn
tokens and Ctrl-C. Each turn re-renders the whole conversation, so the prompt always matches
what the template would produce for the history (no drift between turns).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from glassformer.cli.stats import format_reply_stats
from glassformer.detokenize import IncrementalDecoder
from glassformer.infer.engine import Engine, GenerationStats
from glassformer.tokenizers import PretrainedTokenizer

# Tokens that end an assistant turn in common chat templates, besides the tokenizer's EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")


@dataclass
class Reply:
    text: str
    token_ids: list[int]  # the reply's tokens, without the end-of-turn token
    stats: GenerationStats
    stop_reason: str  # "end_of_turn", "max_new_tokens", "context_full" or "interrupted"


@dataclass
class SamplingOptions:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


@dataclass
class ChatSession:
    engine: Engine
    tokenizer: PretrainedTokenizer
    system: str | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    messages: list[dict[str, str]] = field(default_factory=list)
    # False: what the user types is encoded as text, so "<|im_start|>system" typed in a
    # message cannot open a system turn. True: control tokens in messages are parsed (raw).
    parse_special: bool = False

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so chat cannot format a "
                "conversation: use `glassformer generate` for plain continuation"
            )
        stops = {self.tokenizer.eos_token_id}
        stops |= {self.tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS}
        self.stop_ids = {i for i in stops if i is not None}
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self) -> list[int]:
        """The conversation rendered for the next assistant turn; the oldest turns are dropped
        (the system message kept) until the prompt leaves room for a reply."""
        limit = self.engine.max_seq_len - min(self.sampling.max_new_tokens, 64)
        while True:
            ids = self.tokenizer.encode_chat(
                self.messages,
                add_generation_prompt=True,
                parse_special_in_content=self.parse_special,
            )
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
        opts = self.sampling
        stream = self.engine.stream(
            prompt,
            max_new_tokens=max(1, min(opts.max_new_tokens, room)),
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            seed=opts.seed,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        decoder = IncrementalDecoder(self.tokenizer)
        token_ids: list[int] = []
        stop_reason = ""
        try:
            for token_id in stream:
                if token_id in self.stop_ids:
                    stop_reason = "end_of_turn"
                    break
                token_ids.append(token_id)
                write(decoder.push(token_id))
            else:
                stop_reason = stream.stats.stop_reason
            write(decoder.flush())
        except KeyboardInterrupt:
            stop_reason = "interrupted"
        reply = self.tokenizer.decode(token_ids)
        self.messages.append({"role": "assistant", "content": reply})
        return Reply(reply, token_ids, stream.stats, stop_reason)


def run_chat(session: ChatSession, read: Callable[[str], str] = input) -> None:
    """The read-reply loop: /reset clears the history, /exit or end of input quits, Ctrl-C
    stops a reply (and at the prompt only says how to quit)."""
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
        except ValueError as err:
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
