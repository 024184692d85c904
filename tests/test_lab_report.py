"""The lab's bookkeeping for issue 32: verdict labels carry their counts, `lab run --resume`
skips only current results, ctx.say's words reach the Chinese report, a training run that has
not converged is a failed precondition, and the README's lab summary is the one the committed
results give."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from glassformer.cli import main
from glassformer.lab.base import RunContext, approx, at_least, converged, get, precondition
from glassformer.lab.report import (
    README_BEGIN,
    README_END,
    compute_line,
    load_records,
    not_run,
    readme_summary,
    section_zh,
    update_readme,
    verdict_label,
    write_report_zh,
)
from glassformer.lab.runner import code_hash, program, run_many, run_one

ROOT = Path(__file__).resolve().parent.parent


def _record(checks, verdict: str, zh: dict | None = None) -> dict:
    return {
        "name": "made-up", "number": 99, "title": "t", "claim": "原文", "source": "seed 000",
        "command": "glassformer lab run made-up --tiny", "mode": "tiny", "seed": 0,
        "started": "2026-12-03T00:00:00+00:00", "seconds": 1.0,
        "machine": {"cpu_count": 2, "torch_threads": 1, "torch": "2.13.0"},
        "verdict": verdict, "why": "", "rows": [{"loss": 1.5, "model": "dense"}],
        "checks": [c.to_dict() for c in checks], "figure": None, "notes": ["a note"],
        "data": {}, "zh": zh or {},
    }  # fmt: skip


def test_the_label_counts_the_evidence_that_passed() -> None:
    checks = [at_least("a", 2, 1), at_least("b", 0, 1), at_least("c", 5, 1),
              precondition(at_least("trained", 1, 0))]  # fmt: skip
    assert verdict_label(_record(checks, "holds partly")) == "holds partly: 2 of 3 checks"
    broken = [at_least("a", 2, 1), precondition(at_least("trained", -1, 0))]
    assert verdict_label(_record(broken, "inconclusive")) == "inconclusive: 1 precondition failed"


def test_a_label_never_outlives_its_numbers() -> None:
    """A JSON whose verdict its own checks do not give is refused, not labelled."""
    with pytest.raises(ValueError, match="its checks give 'holds'"):
        verdict_label(_record([at_least("a", 2, 1)], "does not hold here"))


def test_converged_compares_the_last_two_windows() -> None:
    # Closed form: windows [4, 4] then [2, 2] -> drop (4 - 2) / 4 = 0.5.
    check = converged("loss", [9, 9, 4, 4, 2, 2], window=2, tolerance=0.02)
    assert check.role == "precondition" and check.measured == pytest.approx(0.5)
    assert not check.passed
    assert converged("loss", [5, 3, 2.0, 2.0, 1.99, 1.99], 2, 0.02).passed  # 0.5% drop
    with pytest.raises(ValueError, match="cannot show a plateau of 4"):
        converged("loss", [1.0] * 7, 4, 0.02)


def test_say_keeps_one_chinese_word_per_english_one() -> None:
    ctx = RunContext(tiny=True)
    assert ctx.say("loss", "损失") == "loss" and ctx.zh == {"loss": "损失"}
    ctx.say("loss", "损失")  # the same pair again is fine
    with pytest.raises(ValueError, match="both as '损失' and as '误差'"):
        ctx.say("loss", "误差")
    with pytest.raises(ValueError, match="Chinese for 'x' is empty"):
        ctx.say("x", " ")


def test_the_chinese_section_uses_the_experiments_words(tmp_path: Path) -> None:
    checks = [approx("gap at d=4", 0.1, 0, 0.5, group="recall"), at_least("speed-up", 0.5, 1)]
    zh = {"gap at d=4": "d=4 时的差距", "recall": "回忆", "speed-up": "加速比", "loss": "损失",
          "model": "模型", "dense": "稠密", "a note": "一条注释"}  # fmt: skip
    text = section_zh(_record(checks, "holds partly", zh), tmp_path, tmp_path)
    for chinese in ("d=4 时的差距", "回忆：1 项中 1 项通过", "加速比：0.5（要求 >= 1）",
                    "| 损失 | 模型 |", "| 1.5 | 稠密 |", "注：一条注释",
                    "部分成立：2 项检验中 1 项通过"):  # fmt: skip
        assert chinese in text, chinese
    assert "gap at d=4" not in text and "a note" not in text


def test_resume_skips_only_current_results(tmp_path: Path, capsys) -> None:
    ctx = RunContext(out_dir=tmp_path, tiny=True, threads=1)
    exp = get("gqa-cache")
    first = run_one(exp, ctx)
    assert first["code_hash"] == code_hash(exp, ctx)
    path = tmp_path / "gqa-cache.json"
    os.utime(path, (1, 1))
    assert run_many(["gqa-cache"], ctx, echo=True, resume=True) == []
    assert "current" in capsys.readouterr().out and path.stat().st_mtime == 1
    # another seed, or a result written by other code, is not current: rerun
    assert len(run_many(["gqa-cache"], RunContext(out_dir=tmp_path, tiny=True, seed=1),
                        echo=False, resume=True)) == 1  # fmt: skip
    stale = json.loads(path.read_text()) | {"code_hash": "0" * 16}
    path.write_text(json.dumps(stale))
    assert len(run_many(["gqa-cache"], ctx, echo=False, resume=True)) == 1
    assert main(["lab", "run", "gqa-cache", "--tiny", "--resume", "--out", str(tmp_path)]) == 0
    assert "skipped" in capsys.readouterr().out


def test_a_result_stays_current_through_layout_but_not_through_a_changed_number() -> None:
    source = 'def run(ctx):\n    """Train."""\n    return ctx.pick(full=1000, quick=200, tiny=10)\n'
    relaid = (
        '"""A module docstring."""\n\n\ndef run(ctx):  # the sizes\n    """Train longer."""\n'
        "    return ctx.pick(\n        full=1000,\n        quick=200,\n        tiny=10,\n    )\n"
    )
    assert program(source) == program(relaid)
    assert program(source) != program(source.replace("1000", "1500"))
    assert program(source) != program(source.replace('"""Train."""', '"""Train."""\n    x = 1'))


def test_modes_are_exclusive(capsys) -> None:
    assert main(["lab", "run", "gqa-cache", "--quick", "--tiny"]) != 0
    assert "give one of --full, --quick and --tiny" in capsys.readouterr().err


def test_the_chinese_report_counts_and_the_readme_block(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    run_one(get("gqa-cache"), RunContext(out_dir=out, tiny=True, threads=1))
    text = write_report_zh(out, tmp_path / "claims.zh.md").read_text()
    assert "微型模式" in text and "随机种子" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nSTALE\n{README_END}\nrest\n")
    update_readme(load_records(out), readme)
    body = readme.read_text()
    assert body.startswith("# x\n") and body.endswith(f"{README_END}\nrest\n")
    assert readme_summary(load_records(out)) in body and "STALE" not in body
    readme.write_text(
        f"{README_BEGIN}\n{README_END}\n"
        "<!-- LAB TABLE: gqa-cache -->\nOLD\n<!-- END LAB TABLE -->\n"
        "<!-- LAB TABLE: sampling -->\n<!-- END LAB TABLE -->\nend\n"
    )
    update_readme(load_records(out), readme)
    body = readme.read_text()
    rec = load_records(out)[0]
    first = body.split("<!-- LAB TABLE: gqa-cache -->\n", 1)[1].split("<!-- END LAB TABLE -->")[0]
    header = "| " + " | ".join(rec["rows"][0]) + " |"
    assert first.startswith(header) and "OLD" not in first and rec["verdict"] in first
    assert "`sampling` has no published result yet" in body and body.endswith("end\n")


def test_the_readme_summary_is_the_committed_results() -> None:
    """README.md's lab summary says what docs/lab/*.json say (rerun `glassformer lab report`)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert block == readme_summary(load_records(ROOT / "docs" / "lab"))


def test_the_report_names_the_claims_not_run_yet(tmp_path: Path) -> None:
    import tomllib

    import glassformer.lab

    run_one(get("gqa-cache"), RunContext(out_dir=tmp_path, tiny=True, threads=1))
    records = load_records(tmp_path)
    toml = Path(glassformer.lab.__file__).with_name("claims.toml").read_text("utf-8")
    table = tomllib.loads(toml)
    expected = sorted((n for n in table if n != "gqa-cache"), key=lambda n: table[n]["number"])
    assert not_run(records) == expected
    assert f"Not run yet: {len(expected)} claims ({', '.join(expected)})" in compute_line(records)
    assert not_run([{"name": name} for name in table]) == []
