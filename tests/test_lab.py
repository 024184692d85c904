"""The claims lab (issue 7): discovery, every experiment in its tiny mode, the verdict logic
against made-up numbers, the JSON, the report and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from glassformer.cli import main
from glassformer.lab.base import (
    VERDICTS,
    Check,
    Result,
    RunContext,
    approx,
    at_least,
    at_most,
    claims,
    discover,
    exceeds_spread,
    get,
    over_seeds,
    precondition,
    verdict,
    within_spread,
)
from glassformer.lab.report import write_report, write_report_zh
from glassformer.lab.runner import run_one

EXPECTED = {
    "attention-example", "scaling", "no-position-permutation", "rnn-parallel", "long-range",
    "quadratic", "kv-cache-size", "gqa-cache", "parameter-tables", "moe", "residuals",
    "length-extrapolation", "head-pruning", "induction-heads", "it-animal", "sampling",
    "tokens-not-characters", "chunking", "lost-in-the-middle", "gpt-bag-of-words",
    "context-lengths", "activation-memory", "head-split-cost", "position-geometry",
    "rmsnorm-cost", "prefill-decode", "seq2seq-bottleneck", "attention-dilution",
    "in-context-learning", "bert-vs-gpt-classification", "regurgitation", "ffn-knowledge",
    "embedding-distances", "polysemy", "exercise-match-key", "exercise-temperature",
    "lora-works", "thinking-budget", "previous-token-heads", "causal-mask-copying",
    "usage-billing", "streaming-ttft", "moe-balance",
    "data-vs-params", "lora-targets", "cat-ranked-first", "lawyer-assistant", "attention-sinks",
    "inference-cost", "flash-attention-memory", "gqa-decode-throughput", "layernorm-vs-batchnorm",
    "cross-chunk-lost", "hard-truncation", "batch-vs-length", "long-context-memory",
    "rag-retrieval", "rag-encoder",
}  # fmt: skip
# Experiments whose tiny mode loads no real weights: fast enough for the default run.
FAST = ["attention-example", "no-position-permutation", "gqa-cache", "parameter-tables",
        "sampling", "scaling", "quadratic", "rnn-parallel", "long-range", "moe", "residuals",
        "length-extrapolation", "head-pruning", "gpt-bag-of-words", "activation-memory",
        "head-split-cost", "position-geometry", "rmsnorm-cost", "prefill-decode",
        "seq2seq-bottleneck", "attention-dilution", "in-context-learning",
        "bert-vs-gpt-classification", "regurgitation", "ffn-knowledge", "exercise-match-key",
        "exercise-temperature", "thinking-budget", "causal-mask-copying", "moe-balance",
        "data-vs-params", "lora-works", "lora-targets", "flash-attention-memory",
        "gqa-decode-throughput", "cross-chunk-lost", "hard-truncation",
        "batch-vs-length"]  # fmt: skip
SLOW = ["kv-cache-size", "tokens-not-characters", "it-animal", "induction-heads", "chunking",
        "lost-in-the-middle", "context-lengths", "embedding-distances", "polysemy",
        "previous-token-heads", "usage-billing", "streaming-ttft", "cat-ranked-first",
        "lawyer-assistant", "attention-sinks", "inference-cost", "layernorm-vs-batchnorm",
        "long-context-memory", "rag-retrieval", "rag-encoder"]  # fmt: skip


def test_discovery_finds_every_exp_module() -> None:
    experiments = discover()
    assert set(experiments) >= EXPECTED
    modules = {e.fn.__module__ for e in experiments.values()}
    assert all(m.startswith("glassformer.lab.exp_") for m in modules)
    numbers = [e.number for e in experiments.values()]
    assert numbers == sorted(numbers)
    assert len(experiments) >= 35
    for exp in experiments.values():
        about = claims()[exp.name]
        assert about["title_zh"] and about["about_zh"]  # docs/claims.zh.md explains each one
        assert exp.claim and exp.source.startswith("seed 00")
        assert any("\u4e00" <= ch <= "\u9fff" for ch in exp.claim)  # quoted in Chinese


def test_unknown_experiment_names_the_choices() -> None:
    with pytest.raises(ValueError, match="attention-example"):
        get("no-such-claim")


# --- the verdict helper, on made-up numbers ------------------------------------------------


def test_check_ops() -> None:
    assert approx("a", 0.503, 0.5, 0.005).passed
    assert not approx("a", 0.6, 0.5, 0.05).passed
    assert at_least("b", 2, 2).passed and not at_least("b", 1.9, 2).passed
    assert at_most("c", 2, 2).passed and not at_most("c", 2.1, 2).passed
    assert not at_least("nan", float("nan"), 0).passed
    with pytest.raises(ValueError, match="op="):
        Check("x", 1.0, "==", 1.0)


def test_verdict_follows_the_checks() -> None:
    good, bad = approx("good", 1.0, 1.0, 0.1), approx("bad", 2.0, 1.0, 0.1)
    assert verdict([good, good])[0] == "holds"
    assert verdict([good, bad])[0] == "holds partly"
    assert verdict([bad, bad])[0] == "does not hold here"
    _, why = verdict([good, bad])
    assert "bad" in why and "good" not in why.split("off:")[1]
    with pytest.raises(ValueError):
        verdict([])


def test_verdict_comes_from_the_evidence_only() -> None:
    """Synthetic measurements pin the rule: passing preconditions cannot rescue failing
    evidence, a failed precondition makes any evidence inconclusive, and preconditions alone
    are no verdict."""
    setup_ok = precondition(at_most("training loss", 1.2, 1.5))
    setup_broken = precondition(at_most("training loss", 3.9, 1.5))
    evidence_fails = at_least("gain over the baseline (nats)", -0.02, 0.05, group="quality")
    evidence_holds = at_least("speedup", 2.5, 1.5, group="speed")
    assert verdict([setup_ok, setup_ok, evidence_fails])[0] == "does not hold here"
    assert verdict([setup_ok, evidence_holds])[0] == "holds"
    decided, why = verdict([setup_ok, evidence_holds, evidence_fails])
    assert decided == "holds partly"
    assert "speed: 1 of 1 pass" in why and "quality: 0 of 1 pass" in why
    decided, why = verdict([setup_broken, evidence_holds])
    assert decided == "inconclusive" and "training loss: 3.9" in why
    with pytest.raises(ValueError, match="at least one evidence check"):
        verdict([setup_ok])
    with pytest.raises(ValueError, match="role="):
        Check("x", 1.0, ">=", 1.0, role="hope")


def test_differences_count_only_beyond_the_spread() -> None:
    import statistics

    a, b = over_seeds([2.0, 2.2, 2.4]), over_seeds([1.9, 2.0, 2.1])
    assert a.mean == pytest.approx(2.2) and a.spread == pytest.approx(
        statistics.stdev([2.0, 2.2, 2.4])
    )
    # the means differ by 0.2, the combined spread is sqrt(0.2² + 0.1²) ≈ 0.224: not a difference
    assert not exceeds_spread("gain", a, b).passed
    assert within_spread("same", a, b).passed
    tight = over_seeds([2.19, 2.2, 2.21])
    assert exceeds_spread("gain", tight, over_seeds([1.99, 2.0, 2.01])).passed
    assert not within_spread("same", tight, over_seeds([1.99, 2.0, 2.01]), tolerance=0.05).passed
    assert over_seeds([3.0]).spread == 0.0
    with pytest.raises(ValueError, match="at least one"):
        over_seeds([])
    assert RunContext(quick=True).seeds() == [0, 1] and len(RunContext().seeds()) == 3
    with pytest.raises(ValueError, match="at least 3 seeds"):
        RunContext().seeds(full=2)


def test_result_rejects_unknown_verdicts() -> None:
    with pytest.raises(ValueError, match="verdict"):
        Result([], [], "maybe", "why")


# --- every experiment in its smallest mode -------------------------------------------------


def _check_record(rec: dict, out: Path) -> None:
    assert rec["verdict"] in VERDICTS
    assert rec["why"] and rec["rows"] and rec["checks"]
    assert all(isinstance(row, dict) for row in rec["rows"])
    # the verdict follows from the recorded numbers, not from the experiment's say-so
    checks = [Check(c["what"], c["measured"], c["op"], c["target"], c["tolerance"], c["role"],
                    c["group"]) for c in rec["checks"]]  # fmt: skip
    assert [c.passed for c in checks] == [c["passed"] for c in rec["checks"]]
    assert verdict(checks)[0] == rec["verdict"]
    assert (out / rec["figure"]).is_file()
    # The Chinese report: every string the report shows was given its Chinese with ctx.say
    shown = [key for row in rec["rows"] for key in row] + [c["what"] for c in rec["checks"]]
    shown += [c["group"] for c in rec["checks"] if c["group"]] + list(rec["notes"])
    untranslated = sorted({s for s in shown if s not in rec["zh"]})
    assert not untranslated, f"{rec['name']}: no ctx.say for {untranslated[:3]}"
    on_disk = json.loads((out / f"{rec['name']}.json").read_text())
    assert on_disk["verdict"] == rec["verdict"] and on_disk["mode"] == "tiny"


@pytest.mark.parametrize("name", FAST)
def test_experiment_tiny(name: str, tmp_path: Path) -> None:
    rec = run_one(get(name), RunContext(out_dir=tmp_path, tiny=True))
    _check_record(rec, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_experiment_tiny_slow(name: str, tmp_path: Path) -> None:
    rec = run_one(get(name), RunContext(out_dir=tmp_path, tiny=True))
    _check_record(rec, tmp_path)


def test_attention_example_numbers(tmp_path: Path) -> None:
    # Independent of the lab: the seed's printed weights, and softmax([1, .25, .375]) by hand.
    import math

    rec = run_one(get("attention-example"), RunContext(out_dir=tmp_path, tiny=True))
    weights = [row["numpy weight"] for row in rec["rows"]]
    assert weights == pytest.approx([0.503, 0.237, 0.260], abs=6e-4)
    e = [math.exp(s) for s in (1.0, 0.25, 0.375)]
    prose = [row["prose softmax"] for row in rec["rows"]]
    assert prose == pytest.approx([x / sum(e) for x in e], abs=1e-4)
    assert rec["verdict"] == "holds partly"  # 0.498/0.235/0.267, not the prose's 0.60/0.16/0.24


def test_gqa_cache_shrinks_by_the_group_size(tmp_path: Path) -> None:
    rec = run_one(get("gqa-cache"), RunContext(out_dir=tmp_path, tiny=True))
    for row in rec["rows"][:4]:
        assert row["shrink (filled)"] == row["n_heads"] / row["n_kv_heads"]


# --- report and CLI ------------------------------------------------------------------------


def test_report_has_a_section_per_result(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    for name in ("attention-example", "parameter-tables"):
        run_one(get(name), RunContext(out_dir=out, tiny=True))
    path = write_report(out, tmp_path / "claims.md")
    text = path.read_text()
    assert "## 1. " in text and "## 9. " in text
    assert "0.503 0.237 0.260" in text  # the claim, quoted
    assert "`glassformer lab run attention-example --tiny`" in text
    assert "![attention-example](lab/attention-example.png)" in text
    assert "holds partly" in text


def test_chinese_report_gives_the_same_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    for name in ("attention-example", "no-position-permutation"):
        run_one(get(name), RunContext(out_dir=out, tiny=True))
    text = write_report_zh(out, tmp_path / "claims.zh.md").read_text()
    assert "## 1. " in text and "## 3. " in text
    assert "0.503 0.237 0.260" in text  # the claim, quoted in the original
    assert re.search(r"\*\*结论：部分成立：\d+ 项检验中 \d+ 项通过。\*\*", text)
    assert re.search(r"\*\*结论：成立：(\d+) 项检验中 \1 项通过。\*\*", text)
    assert "未通过" in text.split("## 1. ")[1].split("## 3. ")[0]  # 0.498 is not the prose's 0.60
    assert "共 2 条论断：成立 1 条，部分成立 1 条" in text
    # a JSON whose checks do not give its verdict is refused, not reported
    path = out / "no-position-permutation.json"
    rec = json.loads(path.read_text())
    path.write_text(json.dumps({**rec, "verdict": "does not hold here"}))
    with pytest.raises(ValueError, match="rerun"):
        write_report_zh(out, tmp_path / "claims.zh.md")


def test_report_without_results_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="lab run --all"):
        write_report(tmp_path, tmp_path / "claims.md")


def test_cli_list_run_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPECTED)
    out = tmp_path / "lab"
    assert main(["lab", "run", "gqa-cache", "--tiny", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "verdict: holds" in printed and "n_kv_heads" in printed
    assert (out / "gqa-cache.json").is_file() and (out / "gqa-cache.png").is_file()
    claims = tmp_path / "claims.md"
    assert main(["lab", "report", "--out", str(out), "--to", str(claims)]) == 0
    assert "gqa-cache" in claims.read_text()
    assert "**结论：" in (tmp_path / "claims.zh.md").read_text()
    assert main(["lab", "run", "--out", str(out)]) == 2  # neither NAME nor --all
    assert "NAME or --all" in capsys.readouterr().err


def test_scaling_statistics_follow_the_closed_forms() -> None:
    """Var[q·k] = d_k for unit-variance components; a scaled row's entropy does not depend on
    d_k; without scaling rows sharpen as d_k grows; the blunt 猫/累/它 example is one-hot."""
    from glassformer.lab.exp_scaling import attention_statistics, worked_example_without_scaling

    small = attention_statistics(16, scaled=True, n_rows=2048, seed=0)
    wide = attention_statistics(256, scaled=True, n_rows=2048, seed=0)
    raw = attention_statistics(256, scaled=False, n_rows=2048, seed=0)
    assert small["variance"] / 16 == pytest.approx(1.0, abs=0.1)
    assert wide["variance"] / 256 == pytest.approx(1.0, abs=0.1)
    assert small["entropy"] == pytest.approx(wide["entropy"], abs=0.05)
    assert raw["entropy"] < 0.5 * wide["entropy"] and raw["max_weight"] > 0.8
    printed, blunt = worked_example_without_scaling()
    assert [round(w, 3) for w in printed] == [0.503, 0.237, 0.26]
    assert max(blunt) > 0.999


def test_trailing_mean_by_hand() -> None:
    from glassformer.lab.base import trailing_mean

    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([2.0, float("nan"), 4.0], 3) == [2.0, 1.0, 2.0]  # nan counts as 0
    assert trailing_mean([1.0, 2.0], 1) == [1.0, 2.0]


def test_first_symbol_task_needs_order() -> None:
    """The bag-of-words task: a permutation of the same symbols changes the answer, and the
    answer is always among them (so chance is 1/L, not 1/vocab)."""
    import torch

    from glassformer.lab.exp_gpt_bag_of_words import LENGTH, QUERY, first_symbol_batch

    batch = first_symbol_batch(64, torch.Generator().manual_seed(0))
    ids, answer = batch["input_ids"], batch["targets"][:, -1]
    assert (ids[:, -1] == QUERY).all() and (batch["targets"][:, :-1] == -100).all()
    assert all(len(set(row[:LENGTH].tolist())) == LENGTH for row in ids)
    assert (answer == ids[:, 0]).all()
    assert len(set(answer.tolist())) > 1  # the answer depends on the order, not a constant


def test_token_labels_show_byte_pieces_as_escapes() -> None:
    # SmolLM2 cuts 猫 into three byte pieces: each tick label is its byte, never U+FFFD
    from glassformer.lab.base import token_label
    from glassformer.tokenize import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    ids = tokenizer.encode("猫", add_special_tokens=False)
    labels = [token_label(tokenizer, i) for i in ids]
    assert "".join(labels) == "".join(f"\\x{b:02x}" for b in "猫".encode())
    assert token_label(tokenizer, tokenizer.encode("\n", add_special_tokens=False)[0]) == "'\\n'"
    assert token_label(None, 7) == "7"
