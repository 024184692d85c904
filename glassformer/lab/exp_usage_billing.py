"""Seed 002 练习 2 第 4 步: record the `usage` every API call returns and check "按 token 计费"
against the tokenizer. A real `glassformer serve` (SmolLM2-135M-Instruct) is called with the
official openai client: completions, chat, and streamed chat with include_usage, for English and
Chinese prompts of similar length. Every call's prompt_tokens is set against the tokenizer's
count of what the model reads (the raw prompt, or the chat template around the messages), its
completion_tokens against the tokens the same model generates greedily in this process, and the
bill per character of the Chinese prompts against the English ones.
"""

from __future__ import annotations

from collections.abc import Callable

from glassformer.chat import end_of_turn_ids
from glassformer.infer.engine import Engine
from glassformer.lab import base as lab
from glassformer.lab.serving import Served, serve

PAIRS = (  # (English, Chinese), each pair about the same number of characters
    (
        "Write a one-line ad for these headphones, please.",
        "给这款降噪耳机写一句广告语，突出音质好、续航长、戴着舒服这三个卖点。",
    ),
    (
        "The cat did not jump onto the table: it was tired.",
        "那只猫没有跳上桌子，因为它太累了。它趴在地毯上，眯着眼睛晒太阳。",
    ),
    (
        "Explain in one sentence why the sky looks blue.",
        "用一句话解释为什么天空看起来是蓝色的，再说说晚霞为什么是红色的。",
    ),
)
KINDS = ("completion", "chat", "streamed chat")
# Threshold: billed by the character, a Chinese prompt would cost per character what an English
# one does (ratio 1); the bill follows tokens when a Chinese character costs at least 1.5 times
# an English one (the seed's 「中文更费 token」, measured on what the server bills).
PER_CHAR_RATIO = 1.5


def call(served: Served, kind: str, text: str, max_tokens: int) -> tuple[str, str, dict]:
    """(reply text, finish_reason, usage as a dict) of one greedy call of `kind`."""
    client = served.client()
    if kind == "completion":
        response = client.completions.create(
            model=served.name, prompt=text, max_tokens=max_tokens, temperature=0
        )
        choice = response.choices[0]
        return choice.text, choice.finish_reason, response.usage.model_dump()
    messages = [{"role": "user", "content": text}]
    if kind == "chat":
        response = client.chat.completions.create(
            model=served.name, messages=messages, max_tokens=max_tokens, temperature=0
        )
        choice = response.choices[0]
        return choice.message.content or "", choice.finish_reason, response.usage.model_dump()
    stream = client.chat.completions.create(
        model=served.name,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    if usage is None:
        raise RuntimeError("a stream with include_usage ended without its usage chunk")
    return "".join(pieces), finish, usage


def prompt_ids(tokenizer, kind: str, text: str) -> list[int]:
    """The tokens the model reads: the raw prompt, or the chat template around the message."""
    if kind == "completion":
        return tokenizer.encode(text)
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def generated_ids(served: Served, ids: list[int], max_tokens: int) -> list[int]:
    """What the same model generates greedily in this process, up to and including the token
    that ended the turn (it was computed like any other)."""
    tokenizer = served.tokenizer
    stops = end_of_turn_ids(tokenizer) | {tokenizer.eos_token_id}
    stops = tuple(sorted(i for i in stops if i is not None))
    result = Engine(served.model).generate(
        ids,
        max_tokens,
        temperature=0.0,
        stop_token_ids=stops,
        eos_token_id=tokenizer.eos_token_id,
    )
    return result.token_ids


def measure(served: Served, max_tokens: int) -> list[dict]:
    """One record per call: language, kind, characters, the server's usage, the references."""
    tokenizer, records = served.tokenizer, []
    for english, chinese in PAIRS:
        for language, text in (("English", english), ("Chinese", chinese)):
            for kind in KINDS:
                reply, finish, usage = call(served, kind, text, max_tokens)
                ids = prompt_ids(tokenizer, kind, text)
                new = generated_ids(served, ids, max_tokens)
                stops = end_of_turn_ids(tokenizer) | {tokenizer.eos_token_id}
                # The server never sends half a character (a reply cut at max_tokens inside a
                # multi-byte one ends before it), so neither does the reference.
                reference = tokenizer.decode([t for t in new if t not in stops]).rstrip("\ufffd")
                records.append(
                    {
                        "language": language,
                        "kind": kind,
                        "text": text,
                        "characters": len(text),
                        "usage": usage,
                        "prompt_reference": len(ids),
                        "completion_reference": len(new),
                        "reply": reply,
                        "finish_reason": finish,
                        "reply_reference": reference,
                        "reply_reencoded": len(tokenizer.encode(reply)) if reply else 0,
                    }
                )
    return records


def per_char_ratios(records: list[dict]) -> list[float]:
    """For each pair: billed prompt tokens per character, Chinese over English (completions,
    where nothing is added around the text)."""
    rate = {
        r["text"]: r["usage"]["prompt_tokens"] / r["characters"]
        for r in records
        if r["kind"] == "completion"
    }
    return [rate[chinese] / rate[english] for english, chinese in PAIRS]


@lab.register("usage-billing")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    max_tokens = ctx.pick(32, 16, 4)
    with serve(ctx, max_seq_len=256) as served:
        records = measure(served, max_tokens)
        description = served.description
    say = ctx.say
    rows = [_row(say, r) for r in records]
    checks = [
        lab.precondition(
            lab.at_least(
                say(
                    "replies equal to the same model's greedy generation in this process",
                    "与本进程内同一模型贪心生成相同的回复",
                ),
                sum(r["reply"] == r["reply_reference"] for r in records),
                len(records),
            )
        )
    ]
    for kind in KINDS:
        mine = [r for r in records if r["kind"] == kind]
        checks.append(_matches(say, kind, mine, "prompt", lambda r: r["prompt_reference"]))
        checks.append(_matches(say, kind, mine, "completion", lambda r: r["completion_reference"]))
    group = say("billed by tokens, not characters", "按 token 而不是按字计费")
    for (english, _), ratio in zip(PAIRS, per_char_ratios(records), strict=True):
        checks.append(
            lab.at_least(
                say(
                    f"billed tokens per character, Chinese / English («{english[:24]}…»)",
                    f"每字计费 token 数，中文 / 英文（「{english[:24]}…」）",
                ),
                ratio,
                PER_CHAR_RATIO,
                group=group,
            )
        )
    notes = _notes(say, description, records, max_tokens)
    figure = _plot(records)
    data = {"records": records, "per_char_ratios": per_char_ratios(records)}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _matches(say, kind: str, records: list[dict], part: str, reference: Callable) -> lab.Check:
    """Evidence: the calls of `kind` whose usage.<part>_tokens equals the reference count."""
    zh_kind = {"completion": "补全", "chat": "对话", "streamed chat": "流式对话"}[kind]
    zh_part = {"prompt": "提示", "completion": "生成"}[part]
    group = {
        "prompt": say(
            "usage.prompt_tokens is the tokenizer's count", "usage.prompt_tokens 就是分词器的计数"
        ),
        "completion": say(
            "usage.completion_tokens is the tokens generated",
            "usage.completion_tokens 就是生成的 token 数",
        ),
    }[part]
    equal = sum(r["usage"][f"{part}_tokens"] == reference(r) for r in records)
    what = say(
        f"{kind} calls whose {part}_tokens equal the reference count",
        f"{zh_kind}调用中 {part}_tokens 等于参照计数（{zh_part}）的次数",
    )
    return lab.at_least(what, equal, len(records), group=group)


def _row(say, r: dict) -> dict:
    usage = r["usage"]
    return {
        say("language", "语言"): r["language"],
        say("call", "调用"): r["kind"],
        say("finish_reason", "finish_reason"): r["finish_reason"],
        say("characters", "字符数"): r["characters"],
        say("prompt_tokens", "prompt_tokens"): usage["prompt_tokens"],
        say("tokenizer's prompt count", "分词器的提示计数"): r["prompt_reference"],
        say("completion_tokens", "completion_tokens"): usage["completion_tokens"],
        say("tokens generated in this process", "本进程生成的 token 数"): r["completion_reference"],
        say("reply re-encoded (tokens)", "回复文本重新分词（token 数）"): r["reply_reencoded"],
        say("total_tokens", "total_tokens"): usage["total_tokens"],
        say("billed prompt tokens per character", "每字计费的提示 token 数"): usage["prompt_tokens"]
        / r["characters"],
    }


def _notes(say, description: str, records: list[dict], max_tokens: int) -> list[str]:
    chat = {r["text"]: r["usage"]["prompt_tokens"] for r in records if r["kind"] == "chat"}
    plain = {r["text"]: r["usage"]["prompt_tokens"] for r in records if r["kind"] == "completion"}
    overheads = sorted({chat[t] - plain[t] for t in chat})
    reencoded = sum(r["reply_reencoded"] == r["usage"]["completion_tokens"] for r in records)
    ratios = per_char_ratios(records)
    stopped = sum(r["finish_reason"] == "stop" for r in records)
    return [
        say(
            f"model: {description}, served by glassformer serve on a loopback port, called "
            f"{len(records)} times with the official openai client (greedy, max_tokens "
            f"{max_tokens})",
            f"模型：{description}，由 glassformer serve 在本机回环端口提供服务，用官方 openai "
            f"客户端调用 {len(records)} 次（贪心，max_tokens {max_tokens}）",
        ),
        say(
            f"a chat call bills {', '.join(map(str, overheads))} prompt tokens more than the "
            "same text as a completion: the chat template (system prompt and turn markers) is "
            "billed as tokens too",
            f"同一段文字作为对话调用比作为补全多计 {', '.join(map(str, overheads))} 个提示 token："
            "聊天模板（系统提示和轮次标记）也按 token 计费",
        ),
        say(
            f"a Chinese character costs {min(ratios):.1f} to {max(ratios):.1f} times the prompt "
            "tokens of an English one at about the same length",
            f"长度相近时，一个中文字符的提示 token 是英文字符的 {min(ratios):.1f} 到 "
            f"{max(ratios):.1f} 倍",
        ),
        say(
            f"re-encoding the reply text gives completion_tokens on {reencoded} of "
            f"{len(records)} calls: the bill counts the tokens the model generated (the one that "
            "ended the turn included), not a re-tokenisation of the text it returns",
            f"把回复文本重新分词，{len(records)} 次调用中有 {reencoded} 次等于 completion_tokens："
            "计费数的是模型生成的 token（包括结束这一轮的那个），而不是对返回文本重新分词",
        ),
        say(
            f"{stopped} of {len(records)} replies ended with the model's own stop token, the "
            f"rest at max_tokens ({max_tokens})",
            f"{len(records)} 个回复中有 {stopped} 个以模型自己的结束 token 收尾，其余停在 "
            f"max_tokens（{max_tokens}）",
        ),
    ]


def _plot(records: list[dict]):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    for kind, marker in zip(KINDS, "osD", strict=True):
        mine = [r for r in records if r["kind"] == kind]
        prompts = [r["usage"]["prompt_tokens"] for r in mine]
        replies = [r["usage"]["completion_tokens"] for r in mine]
        left.plot(
            [r["prompt_reference"] for r in mine],
            prompts,
            marker,
            label=f"{kind}: prompt",
            fillstyle="none",
        )
        left.plot(
            [r["completion_reference"] for r in mine], replies, marker, label=f"{kind}: reply"
        )
    top = max(max(r["usage"]["prompt_tokens"], r["prompt_reference"]) for r in records) * 1.1
    left.plot([0, top], [0, top], "k:", linewidth=1, label="usage = reference")
    left.set_xlabel("tokenizer's count / tokens generated here")
    left.set_ylabel("usage reported by the server (tokens)")
    left.set_title("usage 与分词器计数", fontsize=9)
    left.legend(fontsize=6)
    for language, marker in (("English", "o"), ("Chinese", "s")):
        mine = [r for r in records if r["kind"] == "completion" and r["language"] == language]
        right.plot(
            [r["characters"] for r in mine],
            [r["usage"]["prompt_tokens"] for r in mine],
            marker,
            markersize=8,
            label=language,
        )
    right.set_xlabel("prompt length (characters)")
    right.set_ylabel("billed prompt tokens")
    right.set_title("同样字数，中文计费 token 更多", fontsize=9)
    right.legend(fontsize=7)
    return fig
