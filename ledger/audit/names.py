"""Names of the views and checks: imported by the ``ledger`` command at start-up, so this
module imports nothing heavy."""

VIEWS = (
    "events", "lineage", "commits", "segments", "states", "attempts", "run", "uncommitted",
    "journals",
)  # fmt: skip
"""Names of the views :func:`ledger.audit.views.connect` creates."""

CHECKS = ("coverage", "duplicates", "skips", "abandoned", "progress", "skew")
"""Names of the checks :func:`ledger.audit.checks.check` runs."""
