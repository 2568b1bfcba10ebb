"""/metrics in Prometheus text (prometheus-client): llama-server's set under ``specrun_`` names,
plus what speculation adds (drafted and accepted tokens, acceptance per draft position)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specrun_requests",
            "HTTP requests answered, by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "specrun_prompt_tokens", "Prompt tokens evaluated (cached ones excluded).", registry=r
        )
        self.cached_tokens = Counter(
            "specrun_prompt_cached_tokens", "Prompt tokens reused from the KV cache.", registry=r
        )
        self.prompt_seconds = Counter(
            "specrun_prompt_seconds", "Prompt processing time.", registry=r
        )
        self.predicted = Counter("specrun_tokens_predicted", "Generated tokens.", registry=r)
        self.predicted_seconds = Counter(
            "specrun_tokens_predicted_seconds", "Decode time.", registry=r
        )
        self.n_decode = Counter(
            "specrun_n_decode",
            "Target passes (llama_decode calls of the decode phase).",
            registry=r,
        )
        self.drafted = Counter(
            "specrun_draft_tokens", "Draft tokens verified by the target.", registry=r
        )
        self.accepted = Counter(
            "specrun_draft_tokens_accepted", "Draft tokens the target accepted.", registry=r
        )
        self.rejected_full = Counter(
            "specrun_requests_rejected_queue_full", "Requests answered 503: queue full.", registry=r
        )
        self.cancelled = Counter(
            "specrun_requests_cancelled",
            "Generations stopped early (client gone, shutdown).",
            registry=r,
        )
        self.processing = Gauge(
            "specrun_requests_processing", "Requests generating now (0 to --parallel).", registry=r
        )
        self.deferred = Gauge(
            "specrun_requests_deferred", "Requests waiting in the queue.", registry=r
        )
        self.prompt_tps = Gauge(
            "specrun_prompt_tokens_seconds", "Average prompt throughput in tokens/s.", registry=r
        )
        self.predicted_tps = Gauge(
            "specrun_predicted_tokens_seconds", "Average decode throughput in tokens/s.", registry=r
        )
        self.acceptance = Gauge(
            "specrun_acceptance_rate", "Accepted / drafted, over all requests.", registry=r
        )
        self.acceptance_pos = Gauge(
            "specrun_acceptance_per_position",
            "Acceptance at each draft position, over all requests.",
            ["position"],
            registry=r,
        )
        self.prompt_cache = Gauge(
            "specrun_prompt_cache",
            "The cache of earlier prompts (--cache-ram): entries, bytes, copies saved and put back.",
            ["what"],
            registry=r,
        )
        self._pos_drafted: list[int] = []
        self._pos_accepted: list[int] = []
        self.totals = {
            "prompt": 0,
            "prompt_s": 0.0,
            "gen": 0,
            "gen_s": 0.0,
            "drafted": 0,
            "accepted": 0,
            "served": 0,
        }

    def record(self, stats: Any, prompt_tokens: int) -> None:
        """One finished completion (a SpecStats)."""
        t = self.totals
        evaluated = stats.prefill_tokens
        self.prompt_tokens.inc(evaluated)
        self.cached_tokens.inc(max(0, prompt_tokens - evaluated))
        self.prompt_seconds.inc(stats.prefill_seconds)
        self.predicted.inc(stats.generated)
        self.predicted_seconds.inc(stats.decode_seconds)
        self.n_decode.inc(stats.target_passes)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        t["prompt"] += evaluated
        t["prompt_s"] += stats.prefill_seconds
        t["gen"] += stats.generated
        t["gen_s"] += stats.decode_seconds
        t["drafted"] += stats.drafted
        t["accepted"] += stats.accepted
        if t["prompt_s"] > 0:
            self.prompt_tps.set(t["prompt"] / t["prompt_s"])
        if t["gen_s"] > 0:
            self.predicted_tps.set(t["gen"] / t["gen_s"])
        if t["drafted"]:
            self.acceptance.set(t["accepted"] / t["drafted"])
        for i, (d, a) in enumerate(
            zip(stats.per_position_drafted, stats.per_position_accepted, strict=True)
        ):
            while len(self._pos_drafted) <= i:
                self._pos_drafted.append(0)
                self._pos_accepted.append(0)
            self._pos_drafted[i] += d
            self._pos_accepted[i] += a
            if self._pos_drafted[i]:
                self.acceptance_pos.labels(str(i + 1)).set(
                    self._pos_accepted[i] / self._pos_drafted[i]
                )

    def render(self) -> bytes:
        return generate_latest(self.registry)
