"""One OpenAI response as the engine's events arrive (server/app.py's routes build one per
request): each choice's text decoded incrementally with stop strings held back while streaming
(and never half a character: a reply cut mid-character ends before it), logprobs in OpenAI's
shape (with each token's exact bytes), finish_reason, usage, the server-sent-event chunks of a
stream, and the request's latency and sizes for /metrics once it finishes.
"""

from __future__ import annotations

import codecs
import json
import math
import secrets
import time
from typing import Any, Protocol

from glassformer.detokenize import IncrementalDecoder, StopStringsAfter, TokenBytes
from glassformer.infer.sampling import TokenLogprob
from glassformer.infer.thinking import Segments, ThinkingMarkers
from glassformer.server.metrics import Metrics
from glassformer.server.protocol import APIError, SamplingFields
from glassformer.server.scheduler import Failed, Tokens
from glassformer.server.tools import ToolCallStream


class Server(Protocol):
    """What a reply reads from the server that makes it (server/app.py's API), so that this
    module need not import the routes that import it."""

    served: Any  # app.Served: the model's name and tokenizer
    fingerprint: str
    stop_ids: tuple[int, ...]  # end-of-turn ids
    markers: ThinkingMarkers | None  # None: the model does not think
    token_bytes: TokenBytes
    metrics: Metrics


# --- one response ---------------------------------------------------------------------------------


class Reply:
    """One request's response as events arrive: each choice's text (decoded incrementally, stop
    strings held back while streaming), logprobs, finish_reason and usage."""

    def __init__(
        self,
        api: Server,
        kind: str,
        id_prefix: str,
        body: SamplingFields,
        prompt: list[int],
        n_top: int | None,
        arrived: float | None = None,
        tools: bool = False,
    ) -> None:
        self.api, self.kind, self.body, self.prompt, self.n_top = api, kind, body, prompt, n_top
        self.arrived = time.perf_counter() if arrived is None else arrived  # for the latency
        self.chat = kind == "chat.completion"
        self.id = f"{id_prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        tokenizer = api.served.tokenizer
        self.decoders = [IncrementalDecoder(tokenizer, api.token_bytes) for _ in range(body.n)]
        # The answer decoded so far, as far as it can be shown: a tail that could still begin
        # a stop string waits in stop_strings (the same rule as the engine's rows: none matches
        # in the first min_tokens tokens).
        self.texts = [""] * body.n
        self.stop_strings = [
            StopStringsAfter(body.stop or (), body.min_tokens) for _ in range(body.n)
        ]
        self.n_tokens = [0] * body.n  # tokens generated per choice, stop tokens included
        self.sent = [0] * body.n  # characters of texts already streamed
        # A thinking model's reply has two parts: reasoning_content (the thinking segment,
        # without its markers) and content; each token goes to one (infer/thinking.py).
        markers = api.markers if self.chat else None
        self.segments = [Segments(markers.ids, prompt) if markers else None for _ in range(body.n)]
        self.reasoning = [""] * body.n
        self.reasoning_sent = [0] * body.n
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(body.n)]
        self.rows: list[Any] = [None] * body.n
        self.failed: APIError | None = None
        # A stop token (the server's end-of-turn ids, or the request's stop_token_ids) ends the
        # text without showing in it, as vLLM's stop_token_ids do.
        self.stop_ids = {*api.stop_ids, *(body.stop_token_ids or ())}
        # With tools, each answer is read for <tool_call> blocks (server/tools.py): the text
        # outside them is the content, each block a tool call.
        self.calls = [ToolCallStream() for _ in range(body.n)] if tools else None
        self.content = [""] * body.n

    @property
    def done(self) -> bool:
        return self.failed is not None or all(row is not None for row in self.rows)

    def take(self, event, include_usage: bool = False) -> list[dict]:
        """Apply one event; returns the stream chunks it makes."""
        if isinstance(event, Failed):
            self.failed = APIError(
                event.status, event.message, kind="server_error", code=event.code
            )
            return []
        i = event.index
        if isinstance(event, Tokens):
            for token_id in event.token_ids:
                self.n_tokens[i] += 1
                if token_id not in self.stop_ids:
                    self._add(i, token_id, self.decoders[i].push(token_id))
            self.logprobs[i] += event.logprobs
            return [self._chunk(i, self._take_text(i), event.logprobs, None, include_usage)]
        # Finished: the rest of the text (the held tail unless a stop string ended it; not a
        # character the reply was cut in the middle of).
        self.rows[i] = event.row
        stop_strings = self.stop_strings[i]
        self.texts[i] += stop_strings.push(self.decoders[i].finish()) + stop_strings.flush()
        text = self._take_text(i)
        if self.done:
            self._count_finished()
        return [self._chunk(i, text, [], self._finish_reason(i), include_usage)]

    def _count_finished(self) -> None:
        generated = sum(len(row.tokens) for row in self.rows)  # usage's completion_tokens
        seconds = time.perf_counter() - self.arrived
        self.api.metrics.request_finished(seconds, len(self.prompt), generated)

    def _add(self, i: int, token_id: int, piece: str) -> None:
        segments = self.segments[i]
        kind = segments.push(token_id) if segments is not None else "answer"
        if kind == "answer":
            if not self.texts[i] and not self.stop_strings[i].held and segments is not None:
                piece = piece.lstrip()  # the blank line a model writes after </think>
            self.texts[i] += self.stop_strings[i].push_token(piece, self.n_tokens[i])
        elif kind == "thinking":
            self.reasoning[i] += piece if self.reasoning[i] else piece.lstrip()

    def _take_reasoning(self, i: int) -> str:
        piece = self.reasoning[i][self.reasoning_sent[i] :]
        self.reasoning_sent[i] = len(self.reasoning[i])
        return piece

    def _take_text(self, i: int) -> str:
        piece = self.texts[i][self.sent[i] :]
        self.sent[i] = len(self.texts[i])
        return piece

    def _finish_reason(self, i: int) -> str:
        if self.rows[i].stop_reason not in ("eos", "stop"):
            return "length"  # cut by max_tokens: a schema's JSON may be incomplete
        return "tool_calls" if self.calls and self.calls[i].calls else "stop"

    # --- wire formats -------------------------------------------------------------------------

    def _header(self, chunk: bool) -> dict:
        kind = self.kind + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.api.served.name,
            "system_fingerprint": self.api.fingerprint,
        }

    def opening_chunks(self, include_usage: bool) -> list[dict]:
        """Chat streams open each choice with its role, as OpenAI's do."""
        if not self.chat:
            return []
        chunks = []
        for i in range(self.body.n):
            choice = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            chunks.append(
                self._with_usage({**self._header(True), "choices": [choice]}, include_usage)
            )
        return chunks

    def _chunk(self, i, text, logprobs, finish_reason, include_usage) -> dict:
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            choice["delta"] = self._delta(i, text, finish_reason)
            reasoning = self._take_reasoning(i)
            if reasoning:  # the thinking as it comes, beside the content (vLLM, DeepSeek)
                choice["delta"] = {"reasoning_content": reasoning, **choice["delta"]}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs) if logprobs else None
        choice["finish_reason"] = finish_reason
        return self._with_usage({**self._header(True), "choices": [choice]}, include_usage)

    def _delta(self, i: int, text: str, finish_reason: str | None) -> dict:
        """A chat chunk's delta: the new content, and with tools the tool-call deltas."""
        deltas: list[dict] = []
        if self.calls is not None:
            text, deltas = self.calls[i].push(text)
            if finish_reason:
                text += self.calls[i].finish()[0]
            self.content[i] += text
        delta = {"content": text} if text or not (finish_reason or deltas) else {}
        return delta | ({"tool_calls": deltas} if deltas else {})

    def _with_usage(self, chunk: dict, include_usage: bool) -> dict:
        return {**chunk, "usage": None} if include_usage else chunk

    def usage(self) -> dict:
        completion = sum(len(row.tokens) for row in self.rows)
        cached = self.rows[0].stats.cached_prompt_tokens
        usage = {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if any(segments is not None for segments in self.segments):
            reasoning = sum(row.stats.thinking_tokens for row in self.rows)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def usage_chunk(self) -> dict:
        return {**self._header(True), "choices": [], "usage": self.usage()}

    def whole(self) -> dict:
        """The non-streaming response."""
        if self.failed:
            raise self.failed
        choices = []
        for i in range(self.body.n):
            logprobs = self._logprobs(self.logprobs[i]) if self.n_top is not None else None
            choice: dict[str, Any] = {"index": i}
            if self.chat and self.calls is not None:
                calls = self.calls[i].tool_calls()
                content = self.content[i] or (None if calls else "")
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": self.texts[i]}
                if self.segments[i] is not None:
                    choice["message"]["reasoning_content"] = self.reasoning[i].strip() or None
            else:
                choice["text"] = self.texts[i]
            reason = self._finish_reason(i)
            choices.append({**choice, "logprobs": logprobs, "finish_reason": reason})
        return {**self._header(False), "choices": choices, "usage": self.usage()}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        """Chat's `content` entries carry each token's bytes; the legacy completions format has
        no such field, so a token that is part of a character is written "bytes:\\xe4\\xb8"
        there (OpenAI's spelling), and text_offset counts whole characters."""
        if self.n_top is None:
            return None
        text = self.api.token_bytes.text
        if self.chat:
            content = [
                {
                    **self._token_entry(e.token_id, e.logprob),
                    "top_logprobs": [self._token_entry(t, lp) for t, lp in e.top],
                }
                for e in entries
            ]
            return {"content": content, "refusal": None}
        return {
            "tokens": [text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": self._text_offsets(entries),
        }

    def _token_entry(self, token_id: int, logprob: float) -> dict:
        return {
            "token": self.api.token_bytes.text(token_id),
            "logprob": logprob if math.isfinite(logprob) else -9999.0,
            "bytes": list(self.api.token_bytes(token_id)),
        }

    def _text_offsets(self, entries: list[TokenLogprob]) -> list[int]:
        """Where each token starts in the completion, in characters: the characters its
        predecessors' bytes complete (a token that ends mid-character moves the next one on by
        nothing, the token that completes it by the whole character)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offsets, written = [], 0
        for entry in entries:
            offsets.append(written)
            written += len(decoder.decode(self.api.token_bytes(entry.token_id)))
        return offsets

    @staticmethod
    def sse(chunks: list[dict]) -> str:
        return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)
