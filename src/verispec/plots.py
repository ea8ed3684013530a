"""PNG plots (training curves, reliability diagrams, measure charts, the bench matrix).

matplotlib is a dependency; this is the one place that picks its headless backend.
"""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
