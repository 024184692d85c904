"""Thinking mode (seed 000 §2.5.2, issue 18): the engine against a plain greedy loop that
closes the thinking segment by hand at the budget, the segment rule token by token, and the
errors a user meets."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from glassformer.cli import main
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams
from glassformer.infer.thinking import Segments, opens_segment
from glassformer.models import build_model

VOCAB = 40
START, END = VOCAB - 2, VOCAB - 1  # the markers' ids in these tests


def _model() -> torch.nn.Module:
    model = tiny_model(vocab_size=VOCAB, n_kv_heads=None, max_seq_len=64, init_std=0.3, scale=1)
    with torch.no_grad():  # a model that never closes the segment itself: the budget must
        model.lm_head.weight[END] = 0.0
        model.lm_head.weight[START] = 0.0
    return model


def _greedy_with_budget(model, prompt: list[int], budget: int | None, n: int) -> list[int]:
    """The reference: full recompute, argmax, and </think> written by hand once `budget`
    tokens were spent inside the segment the prompt opened."""
    ids, out, thinking, thought = list(prompt), [], True, 0
    for _ in range(n):
        if thinking and budget is not None and thought >= budget:
            token = END
        else:
            with torch.no_grad():
                token = int(model(torch.tensor([ids]))[0, -1].argmax())
        if thinking:
            thinking, thought = token != END, thought + (token != END)
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("budget", [0, 3, 7, None])
def test_budget_closes_the_segment_like_a_hand_written_loop(budget):
    model = _model()
    prompt = [5, 9, 2, START]  # the prompt opens the thinking segment (DeepSeek-R1 style)
    n = 14
    expected = _greedy_with_budget(model, prompt, budget, n)
    params = SamplingParams(temperature=0.0, max_new_tokens=n, think_ids=(START, END),
                            thinking_budget=budget, eos_token_id=None)  # fmt: skip
    engine = Engine(model)
    row = engine.add(prompt, params)
    while not row.finished:
        engine.step()
    assert row.tokens == expected
    stats = row.stats
    if budget is None:
        assert END not in row.tokens and stats.thinking_tokens == n
        assert not stats.thinking_forced_end
    else:
        assert row.tokens[budget] == END  # exactly `budget` thinking tokens, then the marker
        assert stats.thinking_forced_end
        assert stats.thinking_tokens == budget + 1  # the marker counts as thinking output
        assert stats.answer_tokens == n - budget - 1
        assert 0 < stats.thinking_time_s <= stats.total_time_s


@pytest.mark.parametrize("draft_seed", [None, 1])  # None: the target drafts for itself
@pytest.mark.parametrize("budget", [0, 3, 7])
def test_speculative_decoding_closes_the_segment_at_the_budget_too(budget, draft_seed):
    from glassformer.infer.speculative import SpeculativeDecoder

    model = _model()
    draft = model
    if draft_seed is not None:  # another model: some proposals are rejected
        torch.manual_seed(draft_seed)
        draft = build_model(model.cfg).eval()
    prompt, n = [5, 9, 2, START], 14
    params = SamplingParams(temperature=0.0, max_new_tokens=n, think_ids=(START, END),
                            thinking_budget=budget, eos_token_id=None)  # fmt: skip
    decoder = SpeculativeDecoder(model, draft, k=4)
    row = decoder.add(prompt, params)
    while not row.finished:
        decoder.step()
    assert row.tokens == _greedy_with_budget(model, prompt, budget, n)
    assert row.stats.thinking_forced_end and row.stats.thinking_tokens == budget + 1


def test_without_markers_every_token_is_the_answer():
    model = _model()
    engine = Engine(model)
    row = engine.add([5, 9, 2, START], SamplingParams(temperature=0.0, max_new_tokens=6))
    while not row.finished:
        engine.step()
    assert row.stats.thinking_tokens == 0 and row.stats.answer_tokens == 6


def test_segments_rule_token_by_token():
    seg = Segments((START, END), prompt=[1, 2])
    kinds = [seg.push(t) for t in [START, 3, 4, END, 5, START, 6]]
    # a start marker after the answer began is plain text
    assert kinds == ["marker", "thinking", "thinking", "marker", "answer", "answer", "answer"]
    seg = Segments((START, END), prompt=[1, START, 7])  # opened by the prompt
    assert [seg.push(t) for t in [3, END, START, 4]] == ["thinking", "marker", "answer", "answer"]
    seg = Segments((START, END), prompt=[1, START, END])  # --no-think: an empty segment
    assert not seg.thinking
    assert opens_segment([START, 1, END, START], (START, END))
    assert not opens_segment([START, 1, END], (START, END))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(think_ids=(START, END), thinking_budget=-1), "thinking_budget=-1"),
        (dict(thinking_budget=4), "needs the model's thinking markers"),
        (dict(think_ids=(START,)), "must be two token ids"),
    ],
)
def test_bad_thinking_parameters_are_one_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_budget_on_a_model_without_markers_names_model_and_flag(capsys):
    code = main(["generate", "--model", "smollm2", "hi", "--thinking-budget", "3",
                 "--max-new-tokens", "2", "--threads", "1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "--thinking-budget needs a thinking model" in err and "smollm2" in err
    code = main(["generate", "--model", "smollm2", "hi", "--thinking-budget", "-2"])
    assert code == 2 and "--thinking-budget=-2 is below 0" in capsys.readouterr().err


# --- the server: reasoning_content, reasoning_tokens, thinking_budget ------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)  # Qwen3's switch, with the segment opened by the prompt as DeepSeek-R1's template does


def _thinking_chat_model(folder):
    """A tiny random model whose tokenizer (SmolLM2's plus <think> and </think>) and template
    make it a thinking model."""
    from test_server import tiny_chat_model

    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve

    tokenizer = tokenizer_from_gguf(read_gguf(resolve("smollm2")))
    tokenizer.hf.add_special_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    return tiny_chat_model(folder, tokenizer)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from serving import start_server, stop_server

    folder = _thinking_chat_model(tmp_path_factory.mktemp("thinker") / "thinker")
    process, url = start_server(["--model", str(folder)])
    yield url, folder
    stop_server(process)


def test_server_returns_reasoning_content_within_the_budget(thinking_server):
    import openai

    from glassformer.chat import end_of_turn_ids
    from glassformer.interop.pretrained import from_pretrained

    url, folder = thinking_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    ask = dict(model="thinker", messages=messages, max_tokens=14, temperature=0.0)
    reply = client.chat.completions.create(**ask, extra_body={"thinking_budget": 4})

    # The library on the same weights: the engine's own split of the same greedy reply.
    model, tokenizer = from_pretrained(folder)
    prompt = tokenizer.encode_chat(messages)
    assert prompt[-2] == tokenizer.token_to_id("<think>")  # the template opened the segment
    ids = (tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>"))
    params = SamplingParams(temperature=0.0, max_new_tokens=14, think_ids=ids,
                            thinking_budget=4, stop_token_ids=tuple(end_of_turn_ids(tokenizer)),
                            eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    engine = Engine(model, tokenizer=tokenizer)
    row = engine.add(prompt, params)
    while not row.finished:
        engine.step()
    assert row.stats.thinking_forced_end
    message = reply.choices[0].message
    assert message.reasoning_content and message.content  # both parts are there
    assert message.reasoning_content == row.reasoning.strip()
    assert message.content == row.text.lstrip()
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # 4 + </think>
    assert reply.usage.completion_tokens == len(row.tokens)

    # Streamed: the reasoning arrives as reasoning_content deltas, then the content.
    stream = client.chat.completions.create(**ask, stream=True, extra_body={"thinking_budget": 4})
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert reasoning.strip() == message.reasoning_content and content == message.content

    # enable_thinking=False: an empty segment in the prompt, no thinking token at all.
    direct = client.chat.completions.create(
        **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert direct.choices[0].message.reasoning_content is None
    assert direct.usage.completion_tokens_details.reasoning_tokens == 0


def test_server_refuses_a_budget_below_zero(thinking_server):
    import httpx

    url, _ = thinking_server
    body = {"model": "thinker", "messages": [{"role": "user", "content": "hi"}],
            "thinking_budget": -1}  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and "thinking_budget" in response.text
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 200  # and it keeps serving
