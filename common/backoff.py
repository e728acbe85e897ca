"""Retry timing shared by the agent's stream, its OTLP export and the collector's exporters."""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(initial_s: float, max_s: float, rng: random.Random | None = None) -> Iterator[float]:
    """Exponential backoff with full jitter in [d/2, d], d doubling from initial_s up to max_s."""
    rng = rng or random.Random()
    d = initial_s
    while True:
        yield rng.uniform(d / 2, d)
        d = min(d * 2, max_s)
