"""Strategies: which backend a module gets, and why the others were refused (docs/tuning.md; README: "What it does").

Every candidate must build and reproduce eager's outputs on the recorded
samples within its tolerances before it can be chosen; each refusal is kept
as a report entry that `xpupack inspect` shows.

Split by job: `checks` (a candidate checked against eager and timed), `base` (the `Strategy` class and
what the built-in ones share), and one module per built-in strategy (`first_wins`, `fastest`, `only`).
"""

from .base import Strategy
from .checks import Rejected, check_candidate, is_reference, reporting
from .fastest import Fastest
from .first_wins import FirstWins
from .only import Only

__all__ = ["Fastest", "FirstWins", "Only", "Rejected", "Strategy", "check_candidate", "is_reference", "reporting"]
