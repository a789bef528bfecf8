"""mg's Prometheus metrics, shared by every process through prometheus_client's multiprocess
mode (the folder named by PROMETHEUS_MULTIPROC_DIR, set by the launcher before any process
that records metrics starts)."""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

from mg_server.config import MARGIN_BUCKETS


@lru_cache(maxsize=None)
def hook_metrics(buckets: tuple[float, ...] = MARGIN_BUCKETS) -> tuple[Counter, Histogram, Histogram]:
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
    control = Histogram(
        "mg_control_seconds",
        "Time mg's hook adds to a forward in which no row was verified (margins + controller round trip)",
        buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
    )
    return steps, margin, control


@lru_cache(maxsize=None)
def tracked_requests() -> Gauge:
    """Created on first use, in the SGLang scheduler process (the seam's finish watcher sets it)."""
    return Gauge("mg_tracked_requests", "Deterministic requests the seam in SGLang's scheduler tracks now (from "
                 "their first step to their end's report)", multiprocess_mode="mostrecent")


@lru_cache(maxsize=None)
def verifier_up() -> Gauge:
    """mg_verifier_up: set by the controller, and to 0 by the main process while no controller runs
    (one gauge per process; the most recent value is the one shown)."""
    return Gauge("mg_verifier_up", "1 while the deterministic verifier process runs and beats, else 0 (also while "
                 "it, or the controller, restarts)", multiprocess_mode="mostrecent")


@lru_cache(maxsize=None)
def controller_restarts() -> Counter:
    """Created on first use, in the main process (launch.runtime counts the restarts)."""
    return Counter("mg_controller_restarts", "mg controllers started again after one exited or stopped beating "
                   "(each start counts, a failed one too; its verifier starts with it)")


def sglang_version(version: str, tested: bool) -> None:
    """Record the SGLang version served (main process, at start-up)."""
    Gauge("mg_sglang", "The SGLang version mg runs on; tested=\"false\" when --mg-allow-sglang let an untested "
          "version start", ["version", "tested"], multiprocess_mode="max").labels(
              version=version, tested=str(tested).lower()).set(1)


def render(metrics_dir: str) -> bytes:
    """Prometheus text exposition of every process's mg metrics."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)
    return generate_latest(registry)


class ControllerMetrics:
    """Counters of the controller process (MarginGate decisions, verifier calls, audit)."""

    def __init__(self):
        self.steps = Counter("mg_steps", "Protected steps by decision (fast commit or verified)", ["decision"])
        self.verify = Counter("mg_verify", "Steps computed by the deterministic verifier")
        self.repair = Counter("mg_repair", "Checked tokens where the verifier's token differed (the request was "
                              "rolled back there)")
        # once per answer, where no rollback can help: not every disagreement (mg_repair counts those)
        self.missed_flips = Counter("mg_audit_mismatch", "Deterministic answers with a token the verifier would "
                                    "not emit that no rollback could take back (a stream's token let out before its "
                                    "check, or one found by the final audit): verdict mismatch, unless "
                                    "mg_corrections counts its answer completed by the verifier")
        self.corrections = Counter("mg_corrections", "Missed flips whose non-streamed answer the verifier completed "
                                   "from the flip (the response then equals the reference)")
        self.rollbacks = Counter("mg_rollbacks", "Deterministic requests rolled back in place: the verifier's token "
                                 "replaced a fast one, and the answer after it was dropped before anyone saw it")
        self.stale_steps = Counter("mg_stale_steps", "Steps of a timeline rolled back already (dropped)")
        self.dropped_steps = Counter("mg_rollback_dropped_steps", "Decided steps after a flip that its rollback "
                                     "dropped (the seam's rows still in flight count in mg_stale_steps)")
        self.lookahead = Counter("mg_lookahead_steps", "Steps decided after a request's last token (the overlap "
                                 "scheduler's look-ahead forward, a held end's surplus); SGLang drops their tokens")
        # The fast path's margin where the verifier disagreed: tau must stay above these (calibration).
        self.flip_margin = Histogram(
            "mg_flip_margin", "Fast-path top1-top2 margin of steps whose token the verifier changed (rolled back "
            "or a missed flip)", buckets=MARGIN_BUCKETS,
        )
        # requests between their first step and their Finish: 0 once traffic stops (else a leak)
        self.live_requests = Gauge("mg_live_requests", "Deterministic requests the controller holds without their "
                                   "end yet", multiprocess_mode="mostrecent")
        self.pool_waiting = Gauge("mg_verifier_pool_waiting", "Deterministic requests whose checks wait for room "
                                  "in the verifier's K/V pool (many: raise --mg-kv-budget-gb)",
                                  multiprocess_mode="mostrecent")
        self.verifier_up = verifier_up()
        self.verifier_restarts = Counter("mg_verifier_restarts", "Deterministic verifier processes the controller "
                                         "started again after one exited or stopped beating (each start counts, a "
                                         "failed one too)")
        self.verify_errors = Counter("mg_verify_errors", "Verify calls that failed (timeout, verifier down, rejected)")
        self.recomputes = Counter("mg_verifier_recomputes", "Requests whose shadow K/V the verifier evicted for "
                                  "others' (its pool is sized to the deterministic load) and that were computed "
                                  "again from position 0")
        self.reused_rows = Counter("mg_verifier_reused_rows", "Prompt positions the verifier mapped from its prefix "
                                   "cache (an earlier request's K/V of the same tokens) instead of computing them")
        self.arrival_prefills = Counter("mg_arrival_prefills", "Deterministic prompts the verifier computed at their "
                                        "arrival in SGLang's scheduler, before their first step")
        self.verify_seconds = Histogram(
            "mg_verify_seconds", "Latency of one verify call (a check's, a catch-up chunk's or a tail audit's: "
            "one verifier forward), seconds",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        # The profile of a verify call: the verifier's own forward (the rest of mg_verify_seconds
        # is IPC, queueing and result handling) and how many rows it carried (the verified rows
        # plus the catch-up of every token the verifier had not seen).
        self.verifier_forward_seconds = Histogram(
            "mg_verifier_forward_seconds", "The verifier's forward inside one verify call, seconds",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.verify_rows = Histogram(
            "mg_verify_rows", "Rows of the verifier forward serving one verify call (verified rows + catch-up)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
        )


@lru_cache(maxsize=None)
def controller_metrics() -> ControllerMetrics:
    return ControllerMetrics()
