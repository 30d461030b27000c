"""The server's Prometheus metrics (prometheus_client, one registry per app so tests can build
several). The engine thread records tokens and finishes; the HTTP handlers record rejections.
prometheus_client's metrics are thread-safe.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LOOP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("loopstack_requests",
                                "Finished engine requests (one per prompt; its n choices together)",
                                ["finish_reason"], registry=registry)
        self.rejected = Counter("loopstack_rejected_requests", "API requests answered with an error",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("loopstack_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=registry)
        self.generation_tokens = Counter("loopstack_generation_tokens", "Generated tokens", registry=registry)
        self.running = Gauge("loopstack_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("loopstack_requests_waiting", "Requests queued for the engine (queue length)",
                             registry=registry)
        self.free_blocks = Gauge("loopstack_kv_blocks_free", "Free KV-cache blocks", registry=registry)
        self.num_blocks = Gauge("loopstack_kv_blocks", "KV-cache blocks in the pool", registry=registry)
        self.time_to_first_token = Histogram(
            "loopstack_time_to_first_token_seconds", "From arrival to the first generated token",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.inter_token_latency = Histogram(
            "loopstack_inter_token_latency_seconds", "Between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.request_latency = Histogram(
            "loopstack_e2e_request_latency_seconds", "From arrival to the last token",
            buckets=LATENCY_BUCKETS_S, registry=registry)
        self.loops_per_token = Histogram(
            "loopstack_loops_per_token", "Loops (applications of the shared blocks) each token ran",
            buckets=LOOP_BUCKETS, registry=registry)

    def on_token(self, gap_s: float, num_loops: int, is_first: bool) -> None:
        """A generated token, `gap_s` after the request's arrival (first) or its previous token."""
        (self.time_to_first_token if is_first else self.inter_token_latency).observe(gap_s)
        self.loops_per_token.observe(num_loops)
        self.generation_tokens.inc()

    def on_finish(self, finish_reason: str, num_prompt_tokens: int, latency_s: float) -> None:
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_latency.observe(latency_s)

    def on_engine_state(self, num_running: int, num_waiting: int, num_free_blocks: int,
                        num_blocks: int) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.free_blocks.set(num_free_blocks)
        self.num_blocks.set(num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
