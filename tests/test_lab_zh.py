"""Issue 32: the Chinese report needs every table header, check name, group and note in Chinese.
Each experiment here runs in tiny mode; what it shows must have a Chinese entry in its "zh"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from glassformer.lab.base import RunContext, get
from glassformer.lab.runner import run_one

CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
# The experiments that route their words through ctx.say and run in under ~3 s in tiny mode.
TRANSLATED = [
    "activation-memory",
    "attention-dilution",
    "attention-example",
    "embedding-distances",
    "exercise-match-key",
    "gpt-bag-of-words",
]


def shown_strings(rec: dict) -> list[str]:
    """Every English string the report shows for a record: row keys, check names and groups,
    notes."""
    shown = [key for row in rec["rows"] for key in row]
    shown += [c["what"] for c in rec["checks"]]
    shown += [c["group"] for c in rec["checks"] if c["group"]]
    return shown + list(rec["notes"])


@pytest.mark.parametrize("name", TRANSLATED)
def test_every_shown_string_has_chinese(name: str, tmp_path: Path) -> None:
    rec = run_one(get(name), RunContext(out_dir=tmp_path, tiny=True))
    missing = [en for en in shown_strings(rec) if not CJK.search(rec["zh"].get(en, ""))]
    assert rec["rows"] and rec["checks"]
    assert not missing, f"{name}: no Chinese for {missing}"
