"""Constrained decoding: output a program can trust (a JSON Schema, a regex, a grammar).

At every step a constrained row's logits are masked to the tokens its grammar allows, then
sampled as usual (temperature, top-k/p and the penalties still apply, inside the mask); the
row ends when the grammar is complete. The grammar engine is llguidance (the one behind
llama.cpp's, vLLM's and SGLang's `llguidance` backends): it compiles JSON Schema, regexes and
Lark grammars lazily, so a schema costs about a millisecond, and computes one step's mask
over a 49k vocabulary in a few tenths of a millisecond (docs/structured.md compares it with
xgrammar and outlines-core). glassformer writes no parser: this module only turns the
engine's bitmask into a logits mask and keeps one matcher per row.

The grammar sees glassformer's own vocabulary: a Hugging Face tokenizer.json (byte-level BPE,
SentencePiece with byte fallback) is read by llguidance itself; any other tokenizer (the char
vocabulary) is described token by token as its exact bytes (detokenize.TokenBytes).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

KINDS = ("json_schema", "regex", "grammar")
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar larger than this is refused
# JSON whitespace between tokens: at most this run of spaces/newlines (llama.cpp bounds it
# likewise), so a model cannot spend its whole budget on indentation.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}


class ConstraintError(ValueError):
    """A schema, regex or grammar that does not compile, named with the engine's reason."""


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match: kind is "json_schema" (source: the schema as JSON
    text), "regex" (the whole output matches it) or "grammar" (a Lark grammar, llguidance's
    dialect: `start: ...`, regex terminals between slashes, %json for embedded schemas)."""

    kind: str
    source: str

    def describe(self) -> str:
        return f"{self.kind.replace('_', ' ')} {self.source[:60]!r}"


def constraint_from(
    json_schema: Any = None, regex: str | None = None, grammar: str | None = None
) -> Constraint | None:
    """The one constraint among SamplingParams' three fields (None when none is set); a schema
    may be a dict or JSON text. Shapes are checked here, compilation in compile_grammar."""
    given = [
        (k, v) for k, v in zip(KINDS, (json_schema, regex, grammar), strict=True) if v is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(k for k, _ in given)
        raise ConstraintError(f"{names} are both set: constrain a row with one of them")
    kind, value = given[0]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise ConstraintError(f"json_schema is not valid JSON: {err}") from None
        if isinstance(value, bool):
            value = {} if value else {"not": {}}
        if not isinstance(value, dict):
            raise ConstraintError(
                f'json_schema must be a JSON object (a schema such as {{"type": "object"}}),'
                f" got {type(value).__name__}"
            )
        value = json.dumps(value, ensure_ascii=False)  # key order kept: it orders the output
    elif not isinstance(value, str) or not value:
        raise ConstraintError(f"{kind}={value!r} is not allowed: give a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise ConstraintError(
            f"the {kind.replace('_', ' ')} has {len(value):,} characters; the limit is "
            f"{MAX_SPEC_CHARS:,}: split it or simplify it"
        )
    return Constraint(kind, value)


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ConstraintError(
            "constrained decoding needs llguidance: pip install llguidance"
        ) from None
    return llguidance


def grammar_text(constraint: Constraint) -> str:
    """The constraint in llguidance's grammar format (its JSON envelope)."""
    llg = _llguidance()
    if constraint.kind == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
        except ValueError as err:
            raise ConstraintError(f"json_schema: {err}") from None
    if constraint.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(constraint.source)
    return llg.LLMatcher.grammar_from_lark(constraint.source)


@functools.lru_cache(maxsize=64)
def check_constraint(constraint: Constraint) -> None:
    """Compile the constraint without a vocabulary: a bad schema, regex or grammar is a
    ConstraintError naming the engine's reason (in milliseconds, before any row is made).
    Remembered per constraint, so the SamplingParams of a request's n choices, or of a batch's
    rows, validate one schema once (a failure is not remembered: it raises every time)."""
    llg = _llguidance()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar_text(constraint))
    if is_error:
        raise ConstraintError(_one_line(constraint, messages[0]))


def _one_line(constraint: Constraint, message: str) -> str:
    """The engine's message on one line: its first line and its "error: ..." lines (a regex
    error comes with the pattern drawn over several lines, which a log line cannot show)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    kept = lines[:1] + [line for line in lines[1:] if line.startswith("error:")]
    reason = " ".join(kept) or "it does not compile"
    return f"the {constraint.kind.replace('_', ' ')} does not compile: {reason}"


class _ByteVocabulary:
    """A tokenizer llguidance cannot read itself, described token by token (its TokenizerWrapper
    protocol: the bytes of every id, the end id, and an encoder)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        from glassformer.detokenize import TokenBytes

        spell = TokenBytes(tokenizer)
        own = tokenizer.vocab_size
        # Ids past the tokenizer's own (a padded embedding) spell nothing: never allowed.
        self.tokens = [spell(i) if i < own else b"" for i in range(vocab_size)]
        self.eos_token_id = eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = [eos_token_id]
        self.is_tokenizer_wrapper = True
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


def grammar_vocabulary(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """llguidance's view of glassformer's vocabulary (about 0.2 s for 49k tokens: build it
    once per engine). eos_token_id: the id a complete grammar allows to end the row."""
    llg = _llguidance()
    hf = getattr(tokenizer, "hf", None)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        # No end token: a complete grammar ends the row itself (Row stops when the matcher
        # is stopped); llguidance still needs an id, so it gets one past the vocabulary.
        eos_token_id = vocab_size
        vocab_size += 1
    if hf is not None and type(hf.model).__name__ in ("BPE", "Unigram"):
        return llg.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos_token_id)
    return llg.LLTokenizer(_ByteVocabulary(tokenizer, vocab_size, eos_token_id))


class Grammars:
    """Compiles constraints for one vocabulary and hands each row its own matcher. Compiled
    matchers are kept (an LRU of `keep`) and copied for each new row, so a server answering
    the same schema many times compiles it once. Thread-safe: the server checks requests on
    its event loop while the engine thread makes rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None, keep=64):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._vocabulary = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()

    @property
    def vocabulary(self) -> Any:
        if self._vocabulary is None:
            self._vocabulary = grammar_vocabulary(
                self.tokenizer, self.vocab_size, self.eos_token_id
            )
        return self._vocabulary

    def matcher(self, constraint: Constraint) -> RowGrammar:
        """A fresh matcher for one row; ConstraintError when the constraint does not compile."""
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is None:
                llg = _llguidance()
                compiled = llg.LLMatcher(self.vocabulary, grammar_text(constraint), log_level=0)
                if compiled.is_error():
                    raise ConstraintError(_one_line(constraint, compiled.get_error()))
                self._compiled[constraint] = compiled
                if len(self._compiled) > self._keep:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
            return RowGrammar(compiled.deep_copy(), self.vocab_size)


class RowGrammar:
    """One row's place in its grammar: the tokens allowed next, and whether it is complete."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> Tensor:
        """A bool mask (V,) of the tokens the grammar allows next (the end token only where the
        grammar may end here)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(allowed)

    def mask(self, logits: Tensor, also: tuple[int, ...] = ()) -> Tensor:
        """logits (1, V) with every token the grammar forbids at -inf; `also`: ids allowed
        besides (the row's own end tokens, once the grammar may end)."""
        allowed = self.allowed().to(logits.device)
        if also and self.matcher.is_accepting():
            allowed[list(also)] = True
        if not bool(allowed.any()):
            raise ConstraintError(
                "the grammar allows no token here: " + (self.matcher.get_error() or "dead end")
            )
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} broke the grammar: {self.matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """The output so far is complete (it may still go on, as a regex `a+` may)."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Complete and nothing may follow (a JSON object's closing brace)."""
        return self.matcher.is_stopped()
