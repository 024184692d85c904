"""The claims lab's pieces: an Experiment tests one claim quoted from the tutorials, runs in a
RunContext and returns a Result whose verdict follows from Checks (measured number, stated
threshold). Experiments live in glassformer/lab/exp_*.py and register themselves; `discover`
imports them all, so adding one never edits a shared list.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import math
import pkgutil
import tomllib
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

VERDICTS = ("holds", "holds partly", "does not hold here", "inconclusive")
MODES = ("tiny", "quick", "full")  # tiny: the tests' smallest run; quick: < 3 min on 2 cores
ROLES = ("evidence", "precondition")


# --- checks and the verdict -------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One measured number against a threshold fixed in code before the run. op: "~"
    (|measured - target| <= tolerance), ">=" or "<=" (measured against target).

    role: "evidence" (a measurement that could come out either way: the verdict follows from
    these) or "precondition" (the setup did what it intended: a model trained below a loss, a
    cache holding the bytes it should; if one fails, the run says nothing about the claim).
    A check whose outcome is fixed by constants is neither. group: the part of the claim the
    check is evidence for; the verdict's `why` speaks group by group.
    """

    what: str
    measured: float
    op: str
    target: float
    tolerance: float = 0.0
    role: str = "evidence"
    group: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("~", ">=", "<="):
            raise ValueError(f"op={self.op!r} is not known: pick '~', '>=' or '<='")
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r} is not known: pick one of {ROLES}")

    @property
    def passed(self) -> bool:
        if not math.isfinite(self.measured):
            return False
        if self.op == "~":
            return abs(self.measured - self.target) <= self.tolerance
        if self.op == ">=":
            return self.measured >= self.target
        return self.measured <= self.target

    def describe(self) -> str:
        want = (
            f"{self.target:g} ± {self.tolerance:g}"
            if self.op == "~"
            else f"{self.op} {self.target:g}"
        )
        return f"{self.what}: {self.measured:.4g} (want {want})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def approx(what: str, measured: float, target: float, tolerance: float, group: str = "") -> Check:
    return Check(what, float(measured), "~", float(target), float(tolerance), group=group)


def at_least(what: str, measured: float, bound: float, group: str = "") -> Check:
    return Check(what, float(measured), ">=", float(bound), group=group)


def at_most(what: str, measured: float, bound: float, group: str = "") -> Check:
    return Check(what, float(measured), "<=", float(bound), group=group)


@dataclass(frozen=True)
class Spread:
    """One number measured over several seeds: its mean, and its spread, the sample standard
    deviation (0 for a single seed, so tiny runs compare means only)."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def spread(self) -> float:
        n = len(self.values)
        if n < 2:
            return 0.0
        return math.sqrt(sum((v - self.mean) ** 2 for v in self.values) / (n - 1))

    def __str__(self) -> str:
        return f"{self.mean:.4g} ± {self.spread:.2g} (n={len(self.values)})"


def over_seeds(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("over_seeds needs at least one value: run at least one seed")
    return Spread(tuple(float(v) for v in values))


def _combined(a: Spread, b: Spread) -> float:
    return math.sqrt(a.spread**2 + b.spread**2)


def exceeds_spread(what: str, a: Spread, b: Spread, margin: float = 0.0, group: str = "") -> Check:
    """Evidence that a is larger than b by more than noise: the difference of the means against
    the seeds' combined spread sqrt(sa² + sb²), plus a margin fixed in code (0: any difference
    beyond the spread counts)."""
    return Check(what, a.mean - b.mean, ">=", _combined(a, b) + margin, group=group)


def within_spread(
    what: str, a: Spread, b: Spread, tolerance: float = 0.0, group: str = ""
) -> Check:
    """Evidence that a and b do not differ: |mean(a) - mean(b)| within the seeds' combined
    spread plus a tolerance fixed in code (the smallest difference the claim would notice)."""
    return Check(what, a.mean - b.mean, "~", 0.0, _combined(a, b) + tolerance, group=group)


def precondition(check: Check) -> Check:
    """The same check as a precondition of the run rather than evidence for the claim."""
    return replace(check, role="precondition")


def converged(what: str, losses: Sequence[float], window: int, tolerance: float) -> Check:
    """Precondition: a training run reached its plateau. measured: the relative drop of the
    mean loss of its last `window` steps from the mean of the `window` before, at most
    `tolerance` (0.02: a loss still falling by more than 2% means the model is still learning,
    and its numbers say nothing yet about a trained model). Name it for what it shows:
    ctx.say("loss drop over the last 100 steps (baseline)", "...")."""
    if len(losses) < 2 * window:
        raise ValueError(
            f"{what}: {len(losses)} losses cannot show a plateau of {window}: "
            f"log at least {2 * window}"
        )
    last = sum(losses[-window:]) / window
    before = sum(losses[-2 * window : -window]) / window
    drop = (before - last) / abs(before) if before else 0.0
    return Check(what, drop, "<=", tolerance, role="precondition")


def evidence_groups(checks: Sequence[Check]) -> dict[str, list[Check]]:
    """The evidence checks by group, in the order the groups first appear."""
    groups: dict[str, list[Check]] = {}
    for c in checks:
        if c.role == "evidence":
            groups.setdefault(c.group, []).append(c)
    return groups


def verdict(checks: Sequence[Check]) -> tuple[str, str]:
    """(verdict, why) from the evidence only. A failed precondition -> "inconclusive"; every
    evidence check passes -> "holds"; none -> "does not hold here"; else "holds partly".
    `why` says, group by group, how many evidence checks pass, and names the failed ones
    with their numbers after "off:"."""
    evidence = [c for c in checks if c.role == "evidence"]
    if not evidence:
        raise ValueError(
            "a verdict needs at least one evidence check (a measurement that could come out "
            "either way); preconditions alone say nothing about the claim"
        )
    broken = [c for c in checks if c.role == "precondition" and not c.passed]
    if broken:
        misses = "; ".join(c.describe() for c in broken)
        return "inconclusive", f"the setup did not do what it intended, so no verdict: {misses}."
    failed = [c for c in evidence if not c.passed]
    n = len(evidence)
    groups = evidence_groups(evidence)
    summary = "; ".join(
        f"{group or 'the claim'}: {sum(c.passed for c in members)} of {len(members)} pass"
        for group, members in groups.items()
    )
    if not failed:
        return "holds", f"all {n} evidence checks pass ({summary}), e.g. {evidence[0].describe()}."
    misses = "; ".join(c.describe() for c in failed)
    if len(failed) == n:
        return "does not hold here", f"none of the {n} evidence checks pass; off: {misses}."
    return (
        "holds partly",
        f"{n - len(failed)} of {n} evidence checks pass ({summary}); off: {misses}.",
    )


# --- a run's context and result ---------------------------------------------------------------


@dataclass
class RunContext:
    """Where and how big to run. quick: fits in 3 minutes on 2 CPU cores; tiny: the smallest
    run the tests use (shapes right, numbers not meaningful for big-model claims)."""

    out_dir: Path = Path("docs/lab")
    quick: bool = False
    tiny: bool = False
    threads: int | None = None
    seed: int = 0
    # The Chinese report's words: each English string an experiment shows (a table header, a
    # check's name and group, a note) with its Chinese, as ctx.say recorded them.
    zh: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)

    def say(self, en: str, zh: str) -> str:
        """en, remembering zh as its Chinese for the report: rows[ctx.say("loss", "损失")],
        lab.at_least(ctx.say(f"gain at d={d}", f"d={d} 时的增益"), ...)."""
        if not zh.strip():
            raise ValueError(f"the Chinese for {en!r} is empty: give its translation")
        known = self.zh.get(en)
        if known is not None and known != zh:
            raise ValueError(f"{en!r} is said in Chinese both as {known!r} and as {zh!r}: pick one")
        self.zh[en] = zh
        return en

    @property
    def mode(self) -> str:
        return "tiny" if self.tiny else "quick" if self.quick else "full"

    def pick(self, full: Any, quick: Any, tiny: Any) -> Any:
        """A size for this mode: ctx.pick(full=1000, quick=200, tiny=10)."""
        return {"full": full, "quick": quick, "tiny": tiny}[self.mode]

    def seeds(self, full: int = 3, quick: int = 2, tiny: int = 1) -> list[int]:
        """The seeds a training experiment repeats over (ctx.seed, ctx.seed + 1, ...): at least
        3 in full mode, so that a difference can be weighed against the spread."""
        n = self.pick(full=full, quick=quick, tiny=tiny)
        if self.mode == "full" and n < 3:
            raise ValueError(f"full mode runs at least 3 seeds, not {n}: raise full=")
        return [self.seed + i for i in range(n)]

    def figure_path(self, stem: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / f"{stem}.png"


@dataclass
class Result:
    """Rows (the table), the checks the verdict follows from, the verdict and one sentence of
    why, the figure and extra data for the JSON. An experiment hands back its Figure;
    Experiment.run saves it as out_dir/NAME.png and puts the path in its place."""

    rows: list[dict[str, Any]]
    checks: list[Check]
    verdict: str
    why: str
    figure: Figure | Path | None = None
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # e.g. rows skipped and why

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} is not one of {VERDICTS}")

    @classmethod
    def from_checks(cls, rows: list[dict[str, Any]], checks: list[Check], **kwargs: Any) -> Result:
        """The verdict and its why from the checks alone; an experiment's reading of its
        numbers goes into `notes`."""
        decided, why = verdict(checks)
        return cls(rows, checks, decided, why, **kwargs)


# --- experiments and the registry -------------------------------------------------------------


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    claim: str  # quoted from the seed, in Chinese
    source: str  # "seed 000 §4.3" or a seed 002 heading (seed 002 has no numbered sections)
    fn: Callable[[RunContext], Result]
    number: int = 0  # the claim's number in issue 7's list: the report's order

    def run(self, ctx: RunContext) -> Result:
        with cjk_text():
            result = self.fn(ctx)
            if not isinstance(result, Result):
                name = type(result).__name__
                raise TypeError(f"experiment {self.name} returned {name}, not Result")
            # Saved here, so the figure is always named after its experiment; inside cjk_text
            # because matplotlib lays the text out (and picks its font) when the figure is drawn.
            if result.figure is not None and not isinstance(result.figure, Path):
                result.figure = save_figure(result.figure, ctx.figure_path(self.name))
        return result


REGISTRY: dict[str, Experiment] = {}


@functools.cache
def claims() -> dict[str, dict]:
    """lab/claims.toml: each experiment's claim, source, title and number, by name."""
    text = importlib.resources.files("glassformer.lab").joinpath("claims.toml").read_text("utf-8")
    return tomllib.loads(text)


def register(
    name: str,
) -> Callable[[Callable[[RunContext], Result]], Callable[[RunContext], Result]]:
    """Decorator for an experiment's run function: @register("gqa-cache"); what the experiment
    tests (claim, source, title, number) is the table of that name in lab/claims.toml."""
    if name not in claims():
        raise ValueError(
            f"experiment {name!r} has no table in glassformer/lab/claims.toml: add [{name}] "
            "with its number, title, source and claim"
        )
    about = claims()[name]

    def wrap(fn: Callable[[RunContext], Result]) -> Callable[[RunContext], Result]:
        if name in REGISTRY and REGISTRY[name].fn.__module__ != fn.__module__:
            raise ValueError(f"experiment name {name!r} is registered twice: rename one")
        REGISTRY[name] = Experiment(
            name, about["title"], about["claim"], about["source"], fn, about["number"]
        )
        return fn

    return wrap


def discover() -> dict[str, Experiment]:
    """Import every glassformer/lab/exp_*.py (each registers itself); experiments by name, in
    the order of their claim numbers."""
    import glassformer.lab as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.name.startswith("exp_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    ordered = sorted(REGISTRY.values(), key=lambda e: (e.number, e.name))
    return {e.name: e for e in ordered}


def get(name: str) -> Experiment:
    experiments = discover()
    if name not in experiments:
        raise ValueError(
            f"no experiment named {name!r}: pick one of {', '.join(experiments)} "
            "(glassformer lab list shows them)"
        )
    return experiments[name]


# --- models and tokens the experiments share ----------------------------------------------------


def smollm2_or_stand_in(ctx: RunContext, max_seq_len: int = 128) -> tuple[Any, str]:
    """(model, name): SmolLM2-135M, or in tiny mode a random 2-layer model of its shape (vocab
    512), so the tests exercise the experiment without loading weights."""
    if ctx.tiny:
        import torch

        from glassformer.config import ModelConfig
        from glassformer.models import build_model

        torch.manual_seed(ctx.seed)
        cfg = ModelConfig.preset(
            "smollm2-135m", n_layers=2, vocab_size=512, max_seq_len=max_seq_len
        )
        return build_model(cfg).eval(), "SmolLM2-shaped (2 random layers, vocab 512)"
    from glassformer.interop.pretrained import from_pretrained

    return from_pretrained("smollm2")[0], "SmolLM2-135M"


def token_label(tokenizer: Any, token_id: int) -> str:
    """A token as a tick label: its text, escaped where it is whitespace or a control character
    (the id when there is no tokenizer)."""
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([token_id])
    if "\ufffd" in text:  # a byte piece of a character: its bytes, as Python writes them
        raw = token_bytes(tokenizer, token_id)
        if raw is not None:
            return "".join(f"\\x{b:02x}" for b in raw)
    return repr(text)[1:-1] if text.strip() else repr(text)


def token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes a byte-level BPE token stands for (its entry spelled in GPT-2's byte alphabet,
    mapped back), or None for a tokenizer of another kind."""
    from glassformer.tokenize import byte_level_chars

    hf = getattr(tokenizer, "hf", None)
    if hf is None or type(hf.decoder).__name__ != "ByteLevel":
        return None
    byte_of = {char: b for b, char in byte_level_chars().items()}
    entry = hf.id_to_token(token_id) or ""
    return bytes(byte_of[c] for c in entry) if all(c in byte_of for c in entry) else None


# --- figures ------------------------------------------------------------------------------------


@contextmanager
def cjk_text():
    """Matplotlib text with a CJK fallback font (inspect.plots' choice) for the duration of one
    experiment: an rc_context, so no global pyplot state is left behind."""
    from matplotlib import rc_context

    from glassformer.inspect.plots import cjk_font

    font = cjk_font()
    families = ["DejaVu Sans", font] if font else ["DejaVu Sans"]
    with rc_context({"font.family": families, "axes.unicode_minus": False}):
        yield


def new_figure(width: float, height: float, ncols: int = 1):
    """(Figure, axes) on a headless Agg canvas of its own (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def grouped_bars(
    ax: Axes, categories: Sequence[str], series: dict[str, Sequence[float]], **tick_style: Any
) -> None:
    """The lab's "ours vs theirs" chart: over each category, one bar per series side by side,
    labelled with the series' name for the legend. tick_style goes to the category labels."""
    width = 0.8 / len(series)  # a group fills 0.8 of the space between two categories
    x = range(len(categories))
    for i, (label, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width  # centres the group on its category
        ax.bar([j + offset for j in x], values, width, label=label)
    ax.set_xticks(x, categories, **tick_style)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Each value's mean with the window - 1 before it (fewer at the start), for loss curves;
    non-finite values (a run that diverged) count as 0 rather than poisoning the rest."""
    out, total = [], 0.0
    finite = [v if math.isfinite(v) else 0.0 for v in values]
    for i, v in enumerate(finite):
        total += v
        if i >= window:
            total -= finite[i - window]
        out.append(total / min(i + 1, window))
    return out


def save_figure(fig, path: Path) -> Path:
    from glassformer.inspect.plots import save

    return save(fig, path, dpi=120)  # legible ticks; the PNGs live in the tree, so no more
