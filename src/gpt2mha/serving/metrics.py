"""The server's Prometheus metrics (``GET /metrics``): vLLM's families under a ``gpt2mha:`` prefix.

Each family has vLLM's (v1 engine) name, type, suffix and ``model_name`` label, so a dashboard,
alert or router written for vLLM reads gpt2mha by swapping the prefix (``vllm:`` → ``gpt2mha:``):

- gauges ``num_requests_running`` (sequences in a slot), ``num_requests_waiting`` (queued for
  one) and ``kv_cache_usage_perc`` (0–1: the tokens the running sequences hold in the cache over
  its ``max_batch × n_ctx`` positions);
- counters ``prompt_tokens_total``, ``generation_tokens_total`` and ``request_success_total``
  by ``finished_reason``: ``stop``, ``length``, ``abort`` (cancelled: a client that hung up, a
  shutdown) and ``error``, vLLM's values;
- counters ``prefix_cache_queries_total`` and ``prefix_cache_hits_total``: prompt tokens looked
  up in the prefix cache and those served from it (vLLM's, in tokens; both 0 while it is off:
  :mod:`gpt2mha.inference.prefix_cache`), read from the scheduler when scraped;
- histograms ``time_to_first_token_seconds`` (submission to first token),
  ``inter_token_latency_seconds`` (between a sequence's consecutive tokens),
  ``e2e_request_latency_seconds`` (submission to finish) and ``request_queue_time_seconds``
  (submission to a slot).

A "request" in these families is one sequence, as in vLLM (which runs a request's ``n`` choices
as that many requests): a completion of P prompts with m = ``best_of`` or ``n`` choices each
counts P·m, and each prefills its prompt. The histograms' buckets are vLLM's plus finer ones
where a CPU's milliseconds fall, so each of vLLM's ``le`` thresholds exists here too.
The process's own families (``process_*``: CPU seconds, resident memory, open files) come with them.

Every instance has its own :class:`prometheus_client.CollectorRegistry`, so several servers in one
process (tests) keep apart. The exposition text is ``prometheus_client``'s.

Source: vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``) and its metrics design
document; the Prometheus text exposition format.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily

from ..inference.text_stream import CANCELLED, ERROR, LENGTH, STOP

#: The prefix of every family (vLLM's is ``vllm:``).
PREFIX = "gpt2mha:"
#: gpt2mha's finish reasons as vLLM's ``finished_reason`` label values.
FINISHED_REASON = {STOP: "stop", LENGTH: "length", CANCELLED: "abort", ERROR: "error"}
#: Seconds: vLLM's boundaries (each of its ``le`` kept) plus finer ones where a CPU's milliseconds fall.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics of one server serving ``model_name``, in their own registry.

    The scheduler reports to it (:meth:`admitted`, :meth:`token`, :meth:`finished`, from its
    thread); the gauges read the scheduler given to :meth:`watch` when scraped (0 before).
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        labels, r = ["model_name"], self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=buckets).labels(model_name)

        self.scheduler = None
        self.running = gauge("num_requests_running", "Sequences in a slot (prefilled or decoding).")
        self.waiting = gauge("num_requests_waiting", "Sequences queued for a slot.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the KV cache's positions in use (0-1): tokens "
                                                     "held by the running sequences over max_batch x n_ctx.")
        for g, i in ((self.running, 0), (self.waiting, 1), (self.kv_usage, 2)):
            g.set_function(lambda i=i: self._occupancy()[i])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (each sequence its own).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(PREFIX + "request_success", "Finished sequences by finished_reason.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, label) for reason, label in FINISHED_REASON.items()}
        self.ttft = histogram("time_to_first_token_seconds", "Submission to first token, seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Between a sequence's consecutive tokens, seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Submission to finish, seconds.", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Submission to admission into a slot, seconds.",
                               REQUEST_BUCKETS)
        r.register(_PrefixCacheCounters(self, model_name))

    def watch(self, scheduler) -> None:
        """Read the gauges from ``scheduler`` (a :class:`~gpt2mha.inference.scheduler.Scheduler`)
        and have it report its sequences here."""
        self.scheduler = scheduler
        scheduler.metrics = self

    def _occupancy(self) -> tuple[int, int, float]:
        return (0, 0, 0.0) if self.scheduler is None else self.scheduler.occupancy()

    # ------------------------------------------------------------- the scheduler's reports
    def admitted(self, seq) -> None:
        """``seq`` got a slot: its queue time and its prompt's tokens."""
        self.queue.observe(seq.t_admit - seq.t_submit)
        self.prompt_tokens.inc(len(seq.prompt_ids))

    def token(self, seq, now: float, previous: float | None) -> None:
        """``seq`` generated a token at ``now`` (monotonic seconds); ``previous``: its last one's time."""
        self.generation_tokens.inc()
        if previous is None:
            self.ttft.observe(now - seq.t_submit)
        else:
            self.itl.observe(now - previous)

    def finished(self, seq) -> None:
        """``seq`` finished (``seq.finish_reason`` set): counted by reason, its end-to-end time."""
        self.success[seq.finish_reason].inc()
        self.e2e.observe(seq.t_end - seq.t_submit)

    def prefix_cache(self) -> tuple[int, int]:
        """``(queries, hits)`` of the watched scheduler's prefix cache, in tokens (0, 0: none)."""
        stats = {} if self.scheduler is None else self.scheduler.prefix_cache_stats()
        return stats.get("queries", 0), stats.get("hits", 0)

    # ------------------------------------------------------------------------ the route
    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCacheCounters:
    """The prefix cache's two counters, read from :meth:`ServerMetrics.prefix_cache` when scraped
    (the engine counts them as it prefills)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def describe(self):
        return self.collect()

    def collect(self):
        queries, hits = self.metrics.prefix_cache()
        for name, doc, value in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
                                 ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", hits)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
