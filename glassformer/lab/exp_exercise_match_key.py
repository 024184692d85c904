"""Seed 002, 练习 1 第 2 步: run the tutorial's 20-line numpy attention as written (its q_it, K
and V), then set the second row of K ("累"'s Key) to the vector the exercise suggests,
[1.0, 0.5, 0.2, 0.8], rerun, and measure whether the weights of "它" flip from "猫" to "累".

The seed's code is copied below line for line; glassformer.numpy_ref.attention is the second
reference. A scan of the key's length (累's key = s × the suggested vector) shows where the flip
would happen: the scores are dot products, so a key's length counts as much as its direction.
"""

from __future__ import annotations

import numpy as np

from glassformer import numpy_ref
from glassformer.lab import base as lab

WORDS = ("猫", "累", "它")
SUGGESTED_KEY = [1.0, 0.5, 0.2, 0.8]  # the exercise's "比如" vector for 累's Key
# What the seed's code prints, to 3 decimals ("≈ [0.503 0.237 0.260]", "≈ [5.03 2.37 2.6 0.]"):
# a precondition that the code below is the seed's code with the seed's numbers.
SEED_WEIGHTS = (0.503, 0.237, 0.260)
SEED_OUTPUT = (5.03, 2.37, 2.6, 0.0)
PRINTED = 0.0005  # half a unit of the printed last digit
# Thresholds: "权重怎么从猫倒向累" says two things that can each come out either way: 累's weight
# rises and 猫's falls (any amount: the change is the point), and 累 ends up with more weight
# than 猫 (a flip: weight(累) - weight(猫) >= 0).
SCALES = np.linspace(0.5, 1.5, 101)  # 累's key = s × SUGGESTED_KEY, for the figure


# --- the seed's code, as written ------------------------------------------------------------


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def seed_q_k_v() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q_it = np.array([1.0, 0.5, 0.2, 0.8])  # "它" 的 Query
    K = np.array(
        [
            [1.1, 0.4, 0.3, 0.9],  # "猫" 的 Key —— 故意设计得跟 q_it 很像
            [0.1, 0.9, 0.1, 0.0],  # "累" 的 Key
            [0.3, 0.2, 0.6, 0.3],  # "它" 的 Key
        ]
    )
    V = np.array(
        [
            [10.0, 0.0, 0.0, 0.0],  # "猫" 的 Value（用好认的整数）
            [0.0, 10.0, 0.0, 0.0],  # "累" 的 Value
            [0.0, 0.0, 10.0, 0.0],  # "它" 的 Value
        ]
    )
    return q_it, K, V


def seed_attention(q_it: np.ndarray, K: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, ...]:
    """(scores, weights, output): the seed's three lines."""
    scores = K @ q_it / np.sqrt(4)  # Q·Kᵀ / √d
    weights = softmax(scores)
    output = weights @ V  # 按权重混合 Value
    return scores, weights, output


def with_key(K: np.ndarray, row: int, key: list[float] | np.ndarray) -> np.ndarray:
    """A copy of K with one row replaced: the exercise's edit."""
    changed = K.copy()
    changed[row] = key
    return changed


def flip_scale(q: np.ndarray, K: np.ndarray, row: int, direction: np.ndarray, rival: int) -> float:
    """The length s at which key s × direction in `row` scores as high as key `rival`: the
    softmax ranks by score, so above s the row's word outweighs the rival."""
    return float(K[rival] @ q / (direction @ q))


# --- the experiment ---------------------------------------------------------------------------


@lab.register("exercise-match-key")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    q_it, K, V = seed_q_k_v()
    cat, tired = 0, 1  # rows of K: 猫, 累 (它 is row 2)
    before = seed_attention(q_it, K, V)
    K_new = with_key(K, tired, SUGGESTED_KEY)
    after = seed_attention(q_it, K_new, V)
    reference = numpy_ref.attention(q_it[None], K_new, V)  # the library's six steps

    say = ctx.say
    rows = []
    for label, (scores, weights, output) in (("as written", before), ("累's key changed", after)):
        for i, word in enumerate(WORDS):
            rows.append(
                {
                    say("run", "运行"): label,
                    say("word", "词"): word,
                    say("score q·k/√d", "分数 q·k/√d"): float(scores[i]),
                    say("weight", "权重"): float(weights[i]),
                    say("output dim", "输出维度"): float(output[i]),
                }
            )

    suggested = np.array(SUGGESTED_KEY)
    cosine = float(suggested @ q_it / np.linalg.norm(suggested) / np.linalg.norm(q_it))
    cat_cosine = float(K[cat] @ q_it / np.linalg.norm(K[cat]) / np.linalg.norm(q_it))
    s_flip = flip_scale(q_it, K, tired, suggested, cat)
    w_before, w_after = before[1], after[1]
    checks = [
        lab.precondition(
            lab.approx(
                say(
                    f"weight on {word} as written (seed prints {seed:g})",
                    f"原样运行时 {word} 的权重（教程打印 {seed:g}）",
                ),
                w_before[i],
                seed,
                PRINTED,
            )
        )
        for i, (word, seed) in enumerate(zip(WORDS, SEED_WEIGHTS, strict=True))
    ]
    checks.append(
        lab.precondition(
            lab.approx(
                say("max |output - seed's printed output|", "max |输出 - 教程打印的输出|"),
                float(np.abs(before[2] - np.array(SEED_OUTPUT)).max()),
                0,
                0.005 + 1e-9,
            )
        )
    )
    checks.append(
        lab.precondition(
            lab.approx(
                say(
                    "max |seed code - numpy_ref.attention| weights after the change",
                    "修改后权重的 max |教程代码 - numpy_ref.attention|",
                ),
                float(np.abs(reference.weights[0] - w_after).max()),
                0,
                1e-12,
            )
        )
    )
    toward = say("weights move toward 累", "权重向 累 移动")
    flip = say("the weights flip (倒向累)", "权重翻转（倒向累）")
    checks += [
        lab.at_least(
            say("weight on 累: after - before", "累 的权重：修改后减修改前"),
            w_after[tired] - w_before[tired],
            0,
            group=toward,
        ),
        lab.at_most(
            say("weight on 猫: after - before", "猫 的权重：修改后减修改前"),
            w_after[cat] - w_before[cat],
            0,
            group=toward,
        ),
        lab.at_least(
            say("after the change: weight on 累 - weight on 猫", "修改后：累 的权重减 猫 的权重"),
            w_after[tired] - w_after[cat],
            0,
            group=flip,
        ),
    ]

    winner = WORDS[int(np.argmax(w_after))]
    w0, w1 = np.round(w_before, 3).tolist(), np.round(w_after, 3).tolist()
    dot_new, dot_cat = suggested @ q_it, K[cat] @ q_it
    notes = [
        say(
            f"weights as written {w0}, after the change "
            f"{w1} (猫, 累, 它): the largest weight is now on {winner}.",
            f"原样运行的权重 {w0}，修改后 {w1}（猫、累、它）：最大的权重现在在 {winner} 上。",
        ),
        say(
            f"cosine with q_it: the suggested key {cosine:.3f}, 猫's key {cat_cosine:.3f}; dot "
            f"product with q_it: the suggested key {dot_new:.3f}, 猫's key "
            f"{dot_cat:.3f}: scores are dot products, so length counts as well as "
            f"direction. 累's key would need to be {s_flip:.3f} × the suggested vector to tie "
            "with 猫.",
            f"与 q_it 的余弦：建议的 Key {cosine:.3f}，猫 的 Key {cat_cosine:.3f}；与 q_it 的点积："
            f"建议的 Key {dot_new:.3f}，猫 的 Key {dot_cat:.3f}：分数是点积，所以长度和方向一样"
            f"要紧。累 的 Key 得是建议向量的 {s_flip:.3f} 倍，才能与 猫 打平。",
        ),
    ]
    curves = np.array(
        [seed_attention(q_it, with_key(K, tired, s * suggested), V)[1] for s in SCALES]
    )  # (S, 3)
    figure = _plot(w_before, w_after, curves, s_flip)
    data = {
        "weights_before": w_before.tolist(),
        "weights_after": w_after.tolist(),
        "flip_scale": s_flip,
        "cosine_suggested": cosine,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(w_before: np.ndarray, w_after: np.ndarray, curves: np.ndarray, s_flip: float):
    fig, (left, right) = lab.new_figure(8.4, 3.4, ncols=2)
    lab.grouped_bars(
        left,
        list(WORDS),
        {"as written": w_before.tolist(), "累's key = [1.0, 0.5, 0.2, 0.8]": w_after.tolist()},
    )
    left.set_ylabel("attention weight of 它")
    left.set_title("练习 1.2：改“累”的 Key")
    left.legend(fontsize=7)
    for i, word in enumerate(WORDS):
        right.plot(SCALES, curves[:, i], label=word)
    right.axvline(1.0, color="grey", linestyle=":", label="the suggested vector (s = 1)")
    right.axvline(s_flip, color="black", linestyle="--", label=f"flip at s = {s_flip:.3f}")
    right.set_xlabel("s (累's key = s × [1.0, 0.5, 0.2, 0.8])")
    right.set_ylabel("attention weight of 它")
    right.set_title("key length decides the flip")
    right.legend(fontsize=7)
    return fig
