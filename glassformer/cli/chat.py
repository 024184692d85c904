"""`glassformer chat`: the terminal chat command. The conversation itself (template, history,
end-of-turn tokens, Ctrl-C) lives in glassformer/chat.py."""

from __future__ import annotations

import argparse
import io
import sys

from glassformer.cli.common import (
    DecodeOptions,
    add_command,
    add_decode_flags,
    add_sampling_flags,
    add_thinking_flags,
    decode_engine,
    load_for_decode,
    sampling_kwargs,
    thinking_options,
)


def cmd_chat(args: argparse.Namespace) -> None:
    """interactive chat with a pretrained model (e.g. --model smollm2)

    Chat in the terminal: each turn is rendered with the model's chat template, the reply
    streams as it is generated, and time to first token and tokens/s follow it. /reset clears
    the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply.
    """
    from glassformer.chat import ChatSession, run_chat
    from glassformer.infer.sampling import SamplingParams, check_logit_bias_ids

    options = DecodeOptions.from_args(args)
    model, tokenizer = load_for_decode(args.model, options, "chat needs one with a chat template")
    thinking, suffix = thinking_options(args, tokenizer, args.model)
    sampling = SamplingParams(**sampling_kwargs(args, eos_token_id=None), **thinking)
    check_logit_bias_ids(sampling.logit_bias, model.cfg.vocab_size)  # before any turn starts
    # Bytes on stdin that are not UTF-8 become U+FFFD instead of ending the chat.
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")
    engine = decode_engine(model, tokenizer, options)
    session = ChatSession(
        engine,
        tokenizer,
        system=args.system,
        sampling=sampling,
        parse_special=args.parse_special,
        no_think_suffix=tuple(suffix),
    )
    run_chat(session)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "chat", cmd_chat)
    p.add_argument(
        "--model", required=True, help="alias (smollm2), Hugging Face folder or .gguf file"
    )
    p.add_argument("--system", help="a system message that opens the conversation")
    p.add_argument(
        "--parse-special",
        action="store_true",
        help="read control tokens typed in a message (<|im_start|>, ...) as tokens, not text "
        "(by default typed text can never forge a turn)",
    )
    add_sampling_flags(p, max_new_tokens=512, temperature=0.7)
    add_thinking_flags(p)
    add_decode_flags(p)
