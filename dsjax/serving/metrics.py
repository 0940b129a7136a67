"""Prometheus metrics of one server (`GET /metrics`), in their own registry so several
servers (tests) never share counters. Names follow vLLM's where one exists, under `dsjax_`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX_METRICS = {  # `Engine.prefix_metrics()` keys shown
    "lookups": "requests looked up", "hits": "requests that took cached blocks", "hit_rate": "hits / lookups",
    "prefill_tokens_saved": "prompt tokens taken from the cache", "replayed_tokens": "prompt tokens a cached "
    "block held that were prefilled again", "stored_blocks": "blocks stored", "evicted_blocks": "blocks dropped",
    "device_bytes": "bytes of blocks on the device (now)", "host_bytes": "bytes of blocks in host memory (now)",
    "device_to_host_bytes": "bytes moved to the host tier", "host_to_device_bytes": "bytes brought back from it"}
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, max_slots: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("dsjax_requests_running", "requests holding a decode slot", registry=r)
        self.waiting = Gauge("dsjax_requests_waiting", "requests waiting for a slot", registry=r)
        self.slots_used = Gauge("dsjax_slots_used", "decode slots in use", registry=r)
        self.slots_total = Gauge("dsjax_slots_total", "decode slots", registry=r)
        self.slots_total.set(max_slots)
        self.prompt_tokens = Counter("dsjax_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("dsjax_generation_tokens", "tokens generated and delivered", registry=r)
        self.requests = Counter("dsjax_requests", "finished HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("dsjax_time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.inter_token = Histogram("dsjax_inter_token_latency_seconds", "between a request's tokens", registry=r,
                                     buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("dsjax_e2e_request_latency_seconds", "submit to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.drafts_proposed = Gauge("dsjax_spec_drafts_proposed", "speculative drafts sent to verification "
                                     "(since start)", registry=r)
        self.drafts_accepted = Gauge("dsjax_spec_drafts_accepted", "speculative drafts accepted (since start)",
                                     registry=r)

        self.prefix = {name: Gauge(f"dsjax_prefix_cache_{name}", f"prefix cache: {what} (since start)", registry=r)
                       for name, what in PREFIX_METRICS.items()}

    def observe_tokens(self, n: int, ttft: float | None, per_token_gap: float | None) -> None:
        """n tokens of one request arrived; ttft for its first batch, else the gap since
        its previous batch per token."""
        self.generation_tokens.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        if per_token_gap is not None:
            for _ in range(n):
                self.inter_token.observe(per_token_gap)

    def observe_engine(self, loop) -> None:
        """Occupancy and speculation counters, read by the engine loop after each step."""
        self.running.set(loop.running)
        self.waiting.set(loop.waiting)
        self.slots_used.set(loop.running)
        if loop.engine.num_draft_tokens:
            spec = loop.engine.spec_metrics()
            self.drafts_proposed.set(spec.get("drafts_proposed", 0))
            self.drafts_accepted.set(spec.get("drafts_accepted", 0))
        for name, value in loop.engine.prefix_metrics().items():
            if name in self.prefix:
                self.prefix[name].set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
