"""Seed 002: 「RAG 里管检索的 embedding 模型，多数是 encoder 系的后代」: the retriever is an
encoder.

On the project's RAG evaluation (rag/evaluate.py: invented facts hidden in Shakespeare, one
question each) the same chunks are embedded twice: by MiniLM (an encoder trained for sentence
vectors, as glassformer rag does) and by SmolLM2-135M (a decoder: its last hidden states
averaged over each chunk's tokens). Each question is embedded the same way and the chunks are
ranked by exact cosine similarity, so only the embedding model differs. A question is found at
k when a chunk holding its fact is among the first k.
"""

from __future__ import annotations

import numpy as np

from glassformer.lab import base as lab

# Threshold, stated once: MiniLM's recall@4 above SmolLM2's by at least 0.2 on the lower end of
# the paired difference's 2-standard-error band over the questions. Setup: MiniLM must find the
# facts at all (recall@16 >= 0.5), else neither number says much.
MIN_RECALL_GAP = 0.2
MIN_RECALL = 0.5
KS = (1, 4, 16)


@lab.register("rag-encoder")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    from glassformer.interop.pretrained import from_pretrained
    from glassformer.rag import Encoder, chunk_document
    from glassformer.rag.evaluate import (
        build_corpus,
        holds_fact,
        invent_facts,
        mean_pooled_vectors,
        recall_at,
    )

    say = ctx.say
    # The cost is SmolLM2 embedding every chunk: 500k characters (1,408 chunks) took 22 min, so
    # full embeds 200k characters; quick, for development, 50k
    n_questions = ctx.pick(120, 32, 2)
    corpus_chars = ctx.pick(200_000, 50_000, 6_000)
    facts = invent_facts(n_questions, seed=ctx.seed)
    corpus = build_corpus(facts, corpus_chars)
    encoder = Encoder.load("minilm")
    chunks = [c for d in corpus.documents for c in chunk_document(d, encoder.tokenizer, 128, 32)]
    questions = [f.question for f in facts]
    decoder, tokenizer = from_pretrained("smollm2")
    decoder.eval()

    def decoder_vectors(texts):
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return mean_pooled_vectors(decoder, ids)

    vectors = {
        "MiniLM (encoder)": (encoder.encode([c.text for c in chunks]), encoder.encode(questions)),
        "SmolLM2 (decoder)": (
            decoder_vectors([c.text for c in chunks]),
            decoder_vectors(questions),
        ),
    }
    found = {}
    for name, (chunk_vectors, question_vectors) in vectors.items():
        order = np.argsort(-(question_vectors @ chunk_vectors.T), axis=1)[:, : max(KS)]
        found[name] = [
            [holds_fact(chunks[i], f) for i in row] for f, row in zip(facts, order, strict=True)
        ]
    recall = {name: {k: recall_at(f, k) for k in KS} for name, f in found.items()}
    rows = [
        {
            say("embedding model", "向量模型"): name,
            **{say(f"recall@{k}", f"recall@{k}"): r[k] for k in KS},
        }
        for name, r in recall.items()
    ]
    encoder_name, decoder_name = vectors
    hits = {name: [float(any(r[:4])) for r in f] for name, f in found.items()}
    gap = lab.over_seeds(
        [a - b for a, b in zip(hits[encoder_name], hits[decoder_name], strict=True)]
    )
    se = gap.spread / len(gap.values) ** 0.5
    checks = [
        lab.precondition(
            lab.at_least(
                say("MiniLM recall@16", "MiniLM recall@16"), recall[encoder_name][16], MIN_RECALL
            )
        ),
        lab.at_least(
            say(
                "recall@4: MiniLM − SmolLM2, mean − 2 SE over questions",
                "recall@4：MiniLM − SmolLM2，各问题的均值 − 2 SE",
            ),
            gap.mean - 2 * se,
            MIN_RECALL_GAP,
            group=say("the encoder retrieves better", "encoder 检索得更好"),
        ),
    ]
    notes = [
        say(
            f"{n_questions} questions over {len(chunks)} chunks (128 MiniLM tokens, overlap 32); "
            "exact cosine search for both models, so only the vectors differ",
            f"{n_questions} 个问题、{len(chunks)} 个块（每块 128 个 MiniLM token，重叠 32）；两个"
            "模型都用精确余弦检索，只有向量不同",
        ),
        say(
            "MiniLM (22M parameters) was trained for sentence vectors; SmolLM2 (135M) was "
            "trained to predict the next token and never to embed: this shows that a decoder's "
            "states as they come are a poor retriever, not that architecture alone decides",
            "MiniLM（2200 万参数）专为句向量训练过；SmolLM2（1.35 亿）只训练过预测下一个 "
            "token，从未训练过做向量：这里说明拿来就用的 decoder 状态检索效果差，而不是说只由"
            "结构决定",
        ),
    ]
    data = {"recall": recall, "questions": questions, "found": found}
    return lab.Result.from_checks(rows, checks, figure=_plot(recall), data=data, notes=notes)


def _plot(recall):
    fig, ax = lab.new_figure(5.0, 3.4)
    for name, by_k in recall.items():
        ax.plot(list(by_k), list(by_k.values()), marker="o", label=name)
    ax.set(xscale="log", xlabel="k", ylabel="recall@k", ylim=(0, 1.02), title="retriever")
    ax.legend(fontsize=7)
    return fig
