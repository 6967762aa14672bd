"""``gpt2mha serve --ray``: the server as a Ray Serve application (:mod:`gpt2mha.serving.ray_app`),
N replicas of K threads each on a local Ray started for the command or on a Ray cluster
(``--ray-address``), and :func:`app_builder`, the ``import_path`` of the Ray Serve config file
shipped in the package (``serve run`` / ``serve deploy``).

Every ``serve`` flag means what it means for one server, applied to each replica (``--max-batch``
slots each, ``--api-key``, ``--chat-template``, ``--quantize``, ...); ``--host``/``--port`` are
where Ray Serve's proxy listens (a local Ray only; a running cluster keeps its own); ``--threads``
gives way to ``--threads-per-replica``. Ray is imported only when ``--ray`` runs.
"""

from __future__ import annotations

import functools
import signal
import sys
import time

from .common import number
from .tools import check_serve_args as check_one_server, cmd_serve as serve_one, lora_args, served_model

#: The flags that mean something only with ``--ray`` (their attribute names).
RAY_ONLY = ("replicas", "threads_per_replica", "ray_address", "min_replicas", "max_replicas", "target_ongoing_requests")
#: The config-file keys :func:`app_builder` refuses: Ray's ``http_options`` say where the proxy listens.
PROXY_KEYS = ("host", "port", "ray-address")


def add_arguments(s) -> None:
    """The Ray Serve flags of the ``serve`` parser ``s``; ``serve`` then runs :func:`cmd_serve`."""
    g = s.add_argument_group("Ray Serve", "replicas behind Ray Serve's proxy (pip install 'gpt2mha[ray]'; "
                                          "docs/how-to/scale-out.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: --replicas copies of the server, each with its own engine and "
                        "--threads-per-replica threads, behind Ray's proxy on --host/--port; Ray restarts a replica "
                        "that dies or fails its health check (the scheduler running and warmed up)")
    g.add_argument("--replicas", type=number(int, 1), default=None, metavar="N",
                   help="replicas (default 1); with --max-replicas: the count to start with")
    g.add_argument("--threads-per-replica", type=number(int, 1), default=None, metavar="K",
                   help="torch's threads in each replica, and the CPUs Ray reserves for it (default 1)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to deploy to (host:port of its head, or 'auto': the one this machine "
                        "joined with ray start); default: a local Ray started for this command and stopped with it")
    g.add_argument("--min-replicas", type=number(int, 0), default=None, metavar="N",
                   help="autoscaling: the fewest replicas (default 1; needs --max-replicas)")
    g.add_argument("--max-replicas", type=number(int, 1), default=None, metavar="N",
                   help="autoscaling on requests in flight: the most replicas")
    g.add_argument("--target-ongoing-requests", type=number(float, 0.01), default=None, metavar="R",
                   help="autoscaling: the requests in flight per replica Ray scales towards (default: half of "
                        "--max-batch)")
    s.set_defaults(func=cmd_serve, check=check_serve_args)


def check_serve_args(args, address: bool = True) -> None:
    """``serve``'s checks (:func:`gpt2mha.cli.tools.check_serve_args`), and with ``--ray`` its
    flags': the replica counts, and no ``--threads`` (each replica's is ``--threads-per-replica``).
    ``address``: check that ``--host``/``--port`` can be listened on (skipped for a running
    cluster, ``--ray-address``, whose proxy is already up)."""
    if not args.ray:
        given = [f"--{name.replace('_', '-')}" for name in RAY_ONLY if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --ray (Ray Serve)")
        return check_one_server(args)
    if args.threads is not None:
        raise ValueError("--threads with --ray: each replica's threads are --threads-per-replica")
    autoscaling(args)
    check_one_server(args, address=address and args.ray_address is None)


def autoscaling(args) -> dict | None:
    """Ray's ``autoscaling_config`` the flags ask for, or None (a fixed ``--replicas``).

    Raises:
        ValueError: --min-replicas or --target-ongoing-requests without --max-replicas, a minimum
            above the maximum, or --replicas outside [min, max].
    """
    if args.max_replicas is None:
        alone = [f for f, v in (("--min-replicas", args.min_replicas), ("--target-ongoing-requests",
                                                                          args.target_ongoing_requests)) if v is not None]
        if alone:
            raise ValueError(f"{', '.join(alone)} needs --max-replicas (autoscaling)")
        return None
    low = 1 if args.min_replicas is None else args.min_replicas
    if low > args.max_replicas:
        raise ValueError(f"--min-replicas {low} > --max-replicas {args.max_replicas}")
    config = {"min_replicas": low, "max_replicas": args.max_replicas,
              "target_ongoing_requests": args.target_ongoing_requests or max(1, args.max_batch // 2)}
    if args.replicas is not None:
        if not low <= args.replicas <= args.max_replicas:
            raise ValueError(f"--replicas {args.replicas}: the starting count must be within --min-replicas {low} "
                             f"and --max-replicas {args.max_replicas}")
        config["initial_replicas"] = args.replicas
    return config


def load_served(args) -> tuple:
    """``(model, tokenizer)`` as ``gpt2mha serve`` loads them for ``args``: what each replica
    calls in its own process."""
    return served_model(args)[:2]


def application(args, chat_template: str | None):
    """The Ray Serve application ``args`` (a parsed ``serve --ray`` line) describe (:func:`gpt2mha.serving.ray_app.application`)."""
    from .. import DEFAULT_MODEL
    from ..serving import ray_app

    options = dict(api_key=args.api_key, metrics=not args.no_metrics, max_batch=args.max_batch,
                   max_queue=args.max_queue, batch_invariant=args.batch_invariant, compile=args.compile,
                   lora=lora_args(args.lora), prefix_cache_mb=0 if args.no_prefix_cache else args.prefix_cache_mb,
                   max_body_bytes=args.max_body_bytes, chat_template=chat_template, max_stop=args.max_stop,
                   max_tokens_overflow=args.max_tokens_overflow)
    return ray_app.application(functools.partial(load_served, args), args.served_model_name or args.model or DEFAULT_MODEL,
                               replicas=args.replicas or 1, threads=args.threads_per_replica or 1,
                               autoscaling=autoscaling(args), graceful_timeout=args.graceful_timeout, **options)


def chat_template_of(args) -> str | None:
    from ..serving.chat import load_chat_template

    try:                                      # before any replica loads the model: a bad file fails at once
        return load_chat_template(args.chat_template)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def cmd_serve(args) -> int:
    """``gpt2mha serve``: one server (:func:`gpt2mha.cli.tools.cmd_serve`), or with ``--ray`` the
    Ray Serve application (:func:`serve_on_ray`)."""
    return serve_on_ray(args) if args.ray else serve_one(args)


def serve_on_ray(args) -> int:
    """Deploy the application on Ray (a local one started here, or ``--ray-address``'s) with
    Ray Serve's proxy on ``--host``/``--port``, and serve until SIGINT/SIGTERM; then delete the
    application (each replica drains: its requests in flight get ``--graceful-timeout`` seconds)
    and stop the local Ray."""
    try:
        import ray
        from ray import serve

        from ..serving.ray_app import APP_NAME
    except ImportError as e:
        raise SystemExit(f"error: gpt2mha serve --ray needs Ray Serve ({e}): pip install 'gpt2mha[ray]'") from None
    app = application(args, chat_template_of(args))
    local = args.ray_address is None
    ray.init(address=args.ray_address, logging_level="WARNING")
    previous = signal.signal(signal.SIGTERM, interrupt)       # Ray's own handler would exit without draining
    deployed = False
    try:
        check_cpus(args, ray.cluster_resources().get("CPU", 0))
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:             # a replica that cannot load its model: Ray logged why above
            print(f"error: {e} (the replicas' errors are logged above)", file=sys.stderr)
            return 1
        where = f"http://{args.host}:{args.port}" if local else "the cluster's Serve proxy"
        print(f"gpt2mha on Ray Serve at {where} ({describe(args)}); Ctrl-C or SIGTERM stops it", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if deployed:
            delete(serve, APP_NAME, args.graceful_timeout + DELETE_MARGIN_S)
        if local:
            serve.shutdown()
            ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
    return 0


#: Seconds beyond ``--graceful-timeout`` that stopping the application may take before the command gives up on it.
DELETE_MARGIN_S = 30.0


def delete(serve, name: str, timeout: float) -> None:
    """Delete the application ``name`` (its replicas drain), waiting at most ``timeout`` seconds:
    where Ray's own processes were stopped first (a signal sent to the whole process group
    reaches them too), the deletion never completes."""
    import threading

    print("stopping: the replicas drain (requests in flight finish)", file=sys.stderr)
    worker = threading.Thread(target=serve.delete, args=(name,), name="gpt2mha-ray-delete", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        print(f"warning: the application did not stop within {timeout:g} s (is Ray itself still running? a signal "
              f"to the whole process group stops it too); stopping anyway", file=sys.stderr)


def interrupt(signum, frame):
    """The first SIGTERM as Ctrl-C: :func:`serve_on_ray` then drains and stops; later ones are
    ignored (``timeout`` and process managers may send it twice: to the process, then its
    group), a second Ctrl-C is not."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def check_cpus(args, cpus: float) -> None:
    """Raises ValueError when the cluster's ``cpus`` cannot hold the replicas the flags start."""
    threads = args.threads_per_replica or 1
    config = autoscaling(args)
    start = (config.get("initial_replicas", config["min_replicas"]) if config else args.replicas or 1)
    if start * threads > cpus:
        raise ValueError(f"{start} replica(s) x {threads} thread(s) need {start * threads} CPUs; this Ray cluster has "
                         f"{cpus:g}: fewer --replicas or --threads-per-replica")
    if config and config["max_replicas"] * threads > cpus:
        print(f"warning: --max-replicas {config['max_replicas']} x {threads} thread(s) is more than this Ray cluster's "
              f"{cpus:g} CPUs: replicas beyond them wait for a node", file=sys.stderr)


def describe(args) -> str:
    config = autoscaling(args)
    threads = args.threads_per_replica or 1
    if config:
        return (f"{config['min_replicas']}-{config['max_replicas']} replicas x {threads} thread(s), scaling towards "
                f"{config['target_ongoing_requests']:g} requests in flight each")
    return f"{args.replicas or 1} replica(s) x {threads} thread(s)"


def app_builder(config: dict):
    """The application of a Ray Serve config file (``import_path:
    gpt2mha.cli.ray_serve:app_builder``): its ``args`` are ``gpt2mha serve --ray`` flags without
    the dashes (``model: gpt2``, ``quantize: int8``, ``threads-per-replica: 1``; ``true`` for a
    flag alone, a list for a repeated one), checked as the command line checks them.

    Raises:
        ValueError: an unknown flag or a bad value (the parser's message), or ``host``, ``port`` or
            ``ray-address`` (the config's ``http_options`` place the proxy).
    """
    from . import build_parser

    argv = ["serve", "--ray"]
    for key, value in (config or {}).items():
        flag = str(key).replace("_", "-")
        if flag in PROXY_KEYS:
            raise ValueError(f"args.{key}: the config file's http_options say where Ray Serve listens")
        for v in value if isinstance(value, list) else [value]:
            if v is True:
                argv.append(f"--{flag}")
            elif v is not False and v is not None:
                argv += [f"--{flag}", str(v)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:                        # argparse printed the reason on stderr
        raise ValueError(f"gpt2mha serve {' '.join(argv[1:])}: not a valid command line (see above)") from None
    check_serve_args(args, address=False)
    return application(args, chat_template_of(args))
