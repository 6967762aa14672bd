"""gpt2mha's server as a Ray Serve application: the same app, one engine per replica, replicas
across the cores of one machine or the machines of a Ray cluster.

:class:`GPT2Replica` is a Ray Serve deployment (``@serve.deployment`` + ``@serve.ingress``) whose
ASGI app is the one ``gpt2mha serve`` runs (:func:`~gpt2mha.serving.server.operated_app`: the
completions and chat routes, streaming, logprobs, ``n``, the probes, ``/metrics``, API keys)
over a :class:`~gpt2mha.inference.scheduler.Scheduler` of its own. Ray Serve does what lies around
the replicas: its proxy routes each HTTP request to one (power of two choices on their ongoing
requests), its controller calls each replica's :meth:`GPT2Replica.check_health`, restarts a
replica that failed it or whose process died, scales the replica count on ongoing requests
(``autoscaling_config``) and, on ``serve shutdown`` / ``serve.delete`` / a scale-down, stops
routing to a replica, lets its requests in flight finish (``graceful_shutdown_timeout_s``), then
stops its scheduler.

Each replica reserves ``threads`` of Ray's CPUs (``num_cpus``) and runs that many threads in
torch's products and gpt2mha's kernels (``OMP_NUM_THREADS`` in its environment, and
:func:`~gpt2mha.inference.threads.adopt_threads` in the thread that starts its scheduler), so N
replicas of K threads fill N·K cores without oversubscribing them.

Metrics: ``GET /metrics`` through Ray's proxy answers with the metrics of the replica that got the
request (:mod:`.metrics`). Every replica also hands the same families (all but the inter-token
latency) to Ray's metrics system every second (:class:`ReplicaMetrics`, ``ray.serve.metrics``),
tagged with its ``replica`` and ``deployment``: scraped from each node's Ray metrics port together
with Ray Serve's own (``ray_serve_*``), as ``ray_gpt2mha_*`` (the ``gpt2mha:`` prefix written
``gpt2mha_``: Ray refuses ``:`` in metric names).

``gpt2mha serve --ray`` (:mod:`gpt2mha.cli.ray_serve`) starts this application; the YAML config
shipped beside this module (:data:`CONFIG_FILE`) runs it with ``serve run`` / ``serve deploy``.

Sources: Ray Serve's deployment, ``@serve.ingress``, health-check, autoscaling and custom-metrics
documentation (ray 2.x); vLLM's Ray metrics wrappers (``vllm/v1/metrics/ray_wrappers.py``) for
mirroring an engine's Prometheus families into Ray's.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

from ray import serve
from ray.serve import metrics as ray_metrics

from ..core.classifier import ClassifierConfig
from ..inference.decoders import choose_decoder
from ..inference.scheduler import Scheduler
from ..inference.threads import adopt_threads
from .metrics import FINISHED_REASON, PREFIX, REQUEST_BUCKETS, TTFT_BUCKETS, ServerMetrics
from .operate import Operations
from .server import create_app

log = logging.getLogger("gpt2mha.serve")

#: The application's name in Ray Serve (``serve status``, ``serve.delete``).
APP_NAME = "gpt2mha"
#: The Ray Serve config shipped in the package (``serve run`` / ``serve deploy``), beside this module.
CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_serve.yaml")
#: Seconds a new replica may take to load its model and warm its engine up before Ray counts it failed.
WARM_UP_TIMEOUT_S = 600.0
#: Ray's metric names: :data:`~gpt2mha.serving.metrics.PREFIX` without the colon Ray refuses.
RAY_PREFIX = PREFIX.replace(":", "_")
#: Seconds between two hand-overs of a replica's metrics to Ray (:class:`ReplicaMetrics`).
FLUSH_S = 1.0


class ReplicaMetrics(ServerMetrics):
    """:class:`~gpt2mha.serving.metrics.ServerMetrics` (the replica's own ``/metrics``) that also
    records its families in Ray's metrics (``ray.serve.metrics``: tagged with the replica,
    deployment and application), exported by each node's Ray metrics agent beside Ray Serve's own.

    A Ray metric call costs 0.1-0.2 ms (measured in an actor on a loaded 2-core machine), too much
    for every token on the scheduler's thread: that thread only queues each sequence's times (a
    deque append), and a thread of this object hands them to Ray every ``flush_s`` seconds, with
    the counters' increments since the last time (read from the replica's own registry) and the
    gauges. The inter-token latency, one observation a token, stays in the replica's ``/metrics``.
    """

    def __init__(self, model_name: str, flush_s: float = FLUSH_S):
        super().__init__(model_name)
        self.tags, self.flush_s = {"model_name": model_name}, flush_s
        keys = ("model_name",)

        def gauge(name, doc):
            return ray_metrics.Gauge(RAY_PREFIX + name, doc, tag_keys=keys)

        def counter(name, doc, more=()):
            return ray_metrics.Counter(RAY_PREFIX + name, doc, tag_keys=keys + more)

        def histogram(name, doc, buckets):
            return ray_metrics.Histogram(RAY_PREFIX + name, doc, boundaries=list(buckets), tag_keys=keys)

        self.ray_gauges = [gauge("num_requests_running", "Sequences in a slot (prefilled or decoding)."),
                           gauge("num_requests_waiting", "Sequences queued for a slot."),
                           gauge("kv_cache_usage_perc", "Fraction of the KV cache's positions in use (0-1).")]
        success = counter("request_success", "Finished sequences by finished_reason.", ("finished_reason",))
        #: (Ray counter, the registry's sample, its labels) of each counter mirrored
        self.ray_counters = [
            (counter("prompt_tokens", "Prompt tokens prefilled (each sequence its own)."),
             PREFIX + "prompt_tokens_total", self.tags),
            (counter("generation_tokens", "Tokens generated."), PREFIX + "generation_tokens_total", self.tags),
            *((success, PREFIX + "request_success_total", {**self.tags, "finished_reason": label})
              for label in FINISHED_REASON.values())]
        self.ray_ttft = histogram("time_to_first_token_seconds", "Submission to first token, seconds.", TTFT_BUCKETS)
        self.ray_e2e = histogram("e2e_request_latency_seconds", "Submission to finish, seconds.", REQUEST_BUCKETS)
        self.ray_queue = histogram("request_queue_time_seconds", "Submission to admission into a slot, seconds.",
                                   REQUEST_BUCKETS)
        self.observed: collections.deque = collections.deque()        # (Ray histogram, seconds), to hand over
        self.pushed = [0.0] * len(self.ray_counters)                   # each counter's total handed over
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        threading.Thread(target=self.run, name="gpt2mha-ray-metrics", daemon=True).start()

    def admitted(self, seq) -> None:
        super().admitted(seq)
        self.observed.append((self.ray_queue, seq.t_admit - seq.t_submit))

    def token(self, seq, now: float, previous: float | None) -> None:
        super().token(seq, now, previous)
        if previous is None:
            self.observed.append((self.ray_ttft, now - seq.t_submit))

    def finished(self, seq) -> None:
        super().finished(seq)
        self.observed.append((self.ray_e2e, seq.t_end - seq.t_submit))

    def flush(self) -> None:
        """Hand Ray what happened since the last call: the queued observations, the counters'
        increments, the gauges' values now."""
        with self.lock:
            while self.observed:
                histogram, seconds = self.observed.popleft()
                histogram.observe(seconds, tags=self.tags)
            for i, (counter, sample, labels) in enumerate(self.ray_counters):
                total = self.registry.get_sample_value(sample, labels) or 0.0
                if total > self.pushed[i]:
                    counter.inc(total - self.pushed[i], tags=labels)
                    self.pushed[i] = total
            for gauge, value in zip(self.ray_gauges, self._occupancy()):
                gauge.set(value, tags=self.tags)

    def run(self) -> None:
        while not self.stopped.wait(self.flush_s):
            try:
                self.flush()
            except Exception:                       # a metrics hiccup must not end the mirroring
                log.exception("handing the metrics to Ray failed")

    def close(self) -> None:
        """Hand over what is left and stop the thread."""
        self.stopped.set()
        self.flush()


def replica_problem(ops: Operations) -> str | None:
    """Why a replica serving ``ops`` cannot take requests now (its health check fails), or None:
    the model is not loaded or failed to, the engine has not warmed up, or the scheduler's thread
    is not running (never started, stopped, or ended by an error)."""
    if ops.error is not None:
        return f"the model failed to load: {type(ops.error).__name__}: {ops.error}"
    scheduler = ops.scheduler
    if scheduler is None:
        return "the model is loading"
    if not scheduler.alive:
        return "the scheduler's thread is not running"
    if not scheduler.ready:
        return "the engine is warming up"
    return None


def build_operations(load: Callable[[], tuple], model_name: str, threads: int, api_key: str | None = None,
                     metrics: bool = True, max_batch: int = 16, max_queue: int = 256,
                     batch_invariant: bool | None = None, compile: bool = False, lora: dict | None = None,
                     prefix_cache_mb: float | None = None, **app_options) -> Operations:
    """One replica's app: ``load()`` (``(model, tokenizer)``) and the scheduler over it, in the
    calling thread with ``threads`` threads, behind :class:`~gpt2mha.serving.operate.Operations`
    as ``gpt2mha serve`` builds it (``metrics``: :class:`ReplicaMetrics`). The scheduler is
    started here (its thread warms the engine up); ``app_options``: :func:`~gpt2mha.serving.server.create_app`'s.

    Raises:
        ValueError: threads < 1, lora with compile, or as :func:`~gpt2mha.serving.server.create_app`,
            :class:`~gpt2mha.inference.scheduler.Scheduler` and :class:`~gpt2mha.serving.operate.Operations`;
            whatever ``load`` raises.
    """
    if lora and compile:
        raise ValueError("lora with compile: the compiled step runs no adapters; serve them on the decode view")
    adopt_threads(threads)
    t0 = time.monotonic()
    model, tok = load()
    if lora:
        from ..inference.lora import apply_lora
        apply_lora(model, lora)
    route = choose_decoder(model.eval(), compile=compile, batch_invariant=batch_invariant)
    scheduler = Scheduler(model, tok, max_batch=max_batch, max_queue=max_queue, batch_invariant=batch_invariant,
                          route=route, prefix_cache_mb=prefix_cache_mb)
    classifier = model if isinstance(model.config, ClassifierConfig) else None
    app = create_app(scheduler, model_name, classifier=classifier, **app_options)
    ops = Operations(model_name, api_key=api_key, metrics=False)
    if metrics:
        ops.metrics = ReplicaMetrics(model_name)
    log.info("model %s loaded in %.1f s on %d thread(s); warming up", model_name, time.monotonic() - t0, threads)
    ops.attach(scheduler, app)                    # starts the scheduler from this thread (threads.py)
    return ops


@serve.deployment(name="GPT2Replica")
@serve.ingress()
class GPT2Replica:
    """One replica: a model, its engine and scheduler, and the server's app over them
    (:func:`build_operations`); Ray Serve routes HTTP requests to the app.

    Args:
        load: a function returning ``(model, tokenizer)``, called in the replica's process (it is
            pickled: a module-level function, or a ``functools.partial`` of one).
        model_name: the served name.
        threads: torch's threads in the replica (its ``num_cpus``).
        options: :func:`build_operations`'s keyword arguments (``api_key``, ``max_batch``,
            ``chat_template``, ...).

    The constructor returns once the engine is warmed up (Ray's first health check follows).
    """

    def __init__(self, load: Callable[[], tuple], model_name: str, threads: int = 1, options: dict | None = None):
        self.ops = build_operations(load, model_name, threads, **(options or {}))
        if not self.ops.scheduler.wait_ready(WARM_UP_TIMEOUT_S):
            raise RuntimeError(f"the engine did not warm up within {WARM_UP_TIMEOUT_S:g} s")

    def __serve_build_asgi_app__(self) -> Operations:
        return self.ops

    def check_health(self) -> None:
        """Ray Serve's health check: raises unless the replica's scheduler is running and warmed
        up (:func:`replica_problem`); Ray restarts a replica that keeps failing it."""
        problem = replica_problem(self.ops)
        if problem is not None:
            raise RuntimeError(f"replica unhealthy: {problem}")

    def __del__(self) -> None:
        """Ray Serve calls it when the replica stops, after the app's lifespan stopped the
        scheduler: the metrics still queued go to Ray."""
        metrics = getattr(getattr(self, "ops", None), "metrics", None)       # (None: the constructor failed)
        if isinstance(metrics, ReplicaMetrics):
            metrics.close()


def application(load: Callable[[], tuple], model_name: str, replicas: int = 1, threads: int = 1,
                autoscaling: dict | None = None, graceful_timeout: float = 30.0, max_ongoing_requests: int | None = None,
                **options) -> "serve.Application":
    """The Ray Serve application of ``model_name``: :class:`GPT2Replica` × ``replicas`` (or
    autoscaled: ``autoscaling``, Ray's ``autoscaling_config`` — ``min_replicas``,
    ``max_replicas``, ``target_ongoing_requests``, ``upscale_delay_s``, ... — which replaces
    ``replicas``), each reserving ``threads`` CPUs and running that many threads; for
    ``serve.run`` or a config file's ``import_path``.

    ``graceful_timeout``: seconds a stopping replica's requests in flight may take to finish
    (Ray's ``graceful_shutdown_timeout_s``). ``max_ongoing_requests``: requests Ray sends one
    replica at once (default: its ``max_batch`` slots; more wait in Ray's router, where a new
    replica can take them). ``options``: :func:`build_operations`'s keyword arguments.

    Raises:
        ValueError: replicas or threads < 1, or a negative graceful_timeout.
    """
    for value, name in ((replicas, "replicas"), (threads, "threads")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if not graceful_timeout >= 0:
        raise ValueError(f"graceful_timeout={graceful_timeout!r}: expected seconds >= 0")
    ongoing = max_ongoing_requests or options.get("max_batch", 16)
    scaling = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}
    env = {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    deployment = GPT2Replica.options(
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": env}},
        max_ongoing_requests=ongoing, graceful_shutdown_timeout_s=graceful_timeout, **scaling)
    return deployment.bind(load, model_name, threads, options)
