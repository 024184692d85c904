"""The claims lab (issue 7): one module per checkable claim of the tutorials (exp_*.py). Each
runs the library, prints a table, writes a figure and a JSON, and states whether the claim holds
here. `glassformer lab list | run NAME|--all [--quick] | report` (docs/claims.md).
"""

from glassformer.lab.base import (
    REGISTRY,
    VERDICTS,
    Check,
    Experiment,
    Result,
    RunContext,
    discover,
    get,
    precondition,
    register,
    verdict,
)

__all__ = [
    "REGISTRY",
    "VERDICTS",
    "Check",
    "Experiment",
    "Result",
    "RunContext",
    "discover",
    "get",
    "precondition",
    "register",
    "verdict",
]
