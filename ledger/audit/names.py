"""Names of the views and checks: imported by the ``ledger`` command at start-up, so this
module imports nothing heavy."""

VIEWS = (
    "events", "lineage", "commits", "segments", "states", "attempts", "run", "uncommitted",
    "journals",
)  # fmt: skip
"""Names of the views :func:`ledger.audit.views.connect` creates."""

CHECKS = ("coverage", "duplicates", "skips", "abandoned", "progress", "skew")
"""Names of the checks every run has (``--check all`` runs them)."""

MIXTURE_CHECKS = ("mixture",)
"""Checks of a :class:`ledger.Mixture` run (``--check all`` adds them for one)."""

ALL_CHECKS = (*CHECKS, *MIXTURE_CHECKS)
"""Names of the checks :func:`ledger.audit.checks.check` runs."""
