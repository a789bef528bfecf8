"""mg's Prometheus metrics, shared by every process through prometheus_client's multiprocess
mode (the folder named by PROMETHEUS_MULTIPROC_DIR, set by the launcher before any process
that records metrics starts)."""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess

from mg_server.config import MARGIN_BUCKETS


@lru_cache(maxsize=None)
def hook_metrics(buckets: tuple[float, ...] = MARGIN_BUCKETS) -> tuple[Counter, Histogram]:
    """Created on first use, in the process that records them (the SGLang scheduler)."""
    steps = Counter(
        "mg_deterministic_steps",
        "Decode steps (tokens sampled) of requests that asked for X-Deterministic: 1",
    )
    margin = Histogram(
        "mg_margin",
        "Top-1 minus top-2 pre-sampling logit of deterministic requests' steps",
        buckets=buckets,
    )
    return steps, margin


def render(metrics_dir: str) -> bytes:
    """Prometheus text exposition of every process's mg metrics."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)
    return generate_latest(registry)
