"""Prometheus metrics (prefix ``mmroute_``), on a registry owned by one app.

No module-level metric objects: a ``Metrics`` instance is created per router (tests
run several routers in one process) and passed to the components that record.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

HIT_RATE_BUCKETS = tuple(round(i * 0.05, 2) for i in range(21))  # 0..1 step 0.05
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "mmroute_"
        self.requests = Counter(p + "requests", "Requests by worker and HTTP status", ["worker", "status"], registry=r)
        self.request_duration = Histogram(
            p + "request_duration_seconds", "End-to-end request duration", ["worker"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first streamed byte/token", ["worker"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.predicted_hit_rate = Histogram(
            p + "predicted_hit_rate", "Predicted KV hit rate per request (overlap blocks / request blocks)",
            buckets=HIT_RATE_BUCKETS, registry=r,
        )
        self.actual_cached_ratio = Histogram(
            p + "actual_cached_ratio", "Worker-reported cached_tokens / prompt_tokens", buckets=HIT_RATE_BUCKETS, registry=r
        )
        self.prediction_mismatch = Counter(
            p + "prediction_mismatch", "Requests whose worker-reported cached tokens differ from the prediction",
            ["worker", "direction"], registry=r,
        )
        self.prediction_checked = Counter(
            p + "prediction_checked", "Requests whose prediction was compared with worker-reported cached tokens",
            ["worker"], registry=r,
        )
        self.routing_overhead = Histogram(
            p + "routing_overhead_seconds", "Routing overhead by stage", ["stage"], buckets=OVERHEAD_BUCKETS, registry=r
        )
        self.kv_events = Counter(p + "kv_events", "KV events by worker, type and status", ["worker", "type", "status"], registry=r)
        self.kv_seq_gaps = Counter(p + "kv_seq_gaps", "Sequence gaps detected", ["worker"], registry=r)
        self.kv_replays = Counter(p + "kv_replays", "Replay requests by outcome", ["worker", "outcome"], registry=r)
        self.kv_restarts = Counter(p + "kv_restarts_detected", "Worker restarts detected (sequence went backwards, or the payload at a known seq changed)", ["worker"], registry=r)
        self.kv_decode_errors = Counter(p + "kv_decode_errors", "KV messages that could not be decoded", ["worker"], registry=r)
        self.indexed_blocks = Gauge(p + "indexed_blocks", "Blocks indexed per worker", ["worker"], registry=r)
        self.worker_up = Gauge(p + "worker_up", "1 when the worker is healthy", ["worker"], registry=r)
        self.in_flight = Gauge(p + "in_flight_requests", "Requests in flight per worker", ["worker"], registry=r)
        self.in_flight_tokens = Gauge(p + "in_flight_prefill_tokens", "Booked uncached prefill tokens per worker", ["worker"], registry=r)
        self.retries = Counter(p + "retries", "Requests retried on another worker", ["worker", "reason"], registry=r)
        self.fallback = Counter(p + "routing_fallback", "Requests routed without exact token view", ["reason"], registry=r)
        self.mm_fallback = Counter(p + "mm_fallback", "Multimodal requests routed on their text prefix only", ["reason"], registry=r)
        self.tokenization_verify = Counter(
            p + "tokenization_verify", "Sampled local-vs-worker tokenization comparisons", ["result"], registry=r
        )
        self.remote_tokenize = Counter(p + "remote_tokenize", "Remote /tokenize calls by outcome", ["outcome"], registry=r)
        self.media_fetch = Counter(p + "media_fetch", "Image fetches by outcome", ["outcome"], registry=r)
        self._stages: dict[str, Histogram] = {}
        self.bookings_expired = Counter(p + "bookings_expired", "Stale bookings expired", ["worker"], registry=r)

    def observe_stage(self, stage: str, seconds: float) -> None:
        child = self._stages.get(stage)
        if child is None:  # labels() costs a lock and a dict walk: keep the children
            child = self._stages[stage] = self.routing_overhead.labels(stage)
        child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
