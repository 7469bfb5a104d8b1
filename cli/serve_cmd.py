"""`cag serve`: the HTTP API (REST + OpenAI-compatible) under uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer

from cag.config import get_settings
from cag.errors import CagError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def serve(
    host: Annotated[
        str, typer.Option(help="Interface to bind; loopback by default. Anything else should set CAG_API_KEYS.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model: the embedded default, a Hugging Face folder or hub id. Env: CAG_MODEL."),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Generations admitted at once (default 16); their decoding is batched (CAG_MAX_BATCH). Env: "
            "CAG_WORKERS."
        ),
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="Requests that may wait for a worker; more get 429. Env: CAG_MAX_QUEUE.")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Per-request timeout in seconds. Env: CAG_REQUEST_TIMEOUT_S.")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: critical, error, warning, info, debug.")] = "info",
    no_ui: Annotated[
        bool,
        typer.Option(
            "--no-ui", help="Leave out the chat page at / (404 there; /docs and the API unchanged). Env: CAG_UI=false."
        ),
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(
            "--store", help="Shared snapshot store, s3://bucket/prefix (default: CAG_HOME only). Env: CAG_STORE."
        ),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Serve on Ray Serve with N engine replicas (needs the `ray` extra); 0: plain serve. Env: CAG_REPLICAS."
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray-address", help="Join this Ray cluster (default: start a local Ray instance). Env: CAG_RAY_ADDRESS."
        ),
    ] = None,
    cpus_per_replica: Annotated[
        float | None,
        typer.Option("--cpus-per-replica", help="Ray CPUs per engine replica (default 1). Env: CAG_CPUS_PER_REPLICA."),
    ] = None,
    gpus_per_replica: Annotated[
        float | None,
        typer.Option("--gpus-per-replica", help="GPUs per engine replica (default 0). Env: CAG_GPUS_PER_REPLICA."),
    ] = None,
    min_replicas: Annotated[
        int | None,
        typer.Option("--min-replicas", help="Autoscaling floor (needs --max-replicas). Env: CAG_MIN_REPLICAS."),
    ] = None,
    max_replicas: Annotated[
        int | None, typer.Option("--max-replicas", help="Autoscale up to this many replicas. Env: CAG_MAX_REPLICAS.")
    ] = None,
    target_ongoing_requests: Annotated[
        float | None,
        typer.Option(
            "--target-ongoing-requests",
            help="Autoscaling target per replica (default 2). Env: CAG_TARGET_ONGOING_REQUESTS.",
        ),
    ] = None,
    corpora_per_replica: Annotated[
        int | None,
        typer.Option(
            "--corpora-per-replica", help="Corpora a replica keeps resident (default 3). Env: CAG_CORPORA_PER_REPLICA."
        ),
    ] = None,
    spill_after_s: Annotated[
        float | None,
        typer.Option(
            "--spill-after-s",
            help="Seconds a question waits for a replica holding its corpus before another replica loads it (default "
            "2). Env: CAG_SPILL_AFTER_S.",
        ),
    ] = None,
):
    """Serve the knowledge API: POST /v1/ask, the OpenAI-compatible /v1/chat/completions and /v1/models,
    corpora and refresh jobs, /health, /metrics, docs at /docs, and a chat page at / (unless --no-ui).
    API keys come from CAG_API_KEYS (comma-separated), never from the command line."""
    import uvicorn

    from cag.api.app import create_app
    from cag.api.replica_settings import load_replica_settings
    from cag.api.settings import load_api_settings

    try:  # a bad setting (CAG_API_KEYS=" , ", CAG_WORKERS=0 ...) is one line and exit 1, never an open server
        api_settings = load_api_settings(workers=workers, max_queue=max_queue, request_timeout_s=timeout,
                                         # its address is a Host it answers
                                         ui=False if no_ui else None).serving_on(host)
        cag_settings = get_settings(model=model, store=store)
        scale = load_replica_settings(
            replicas=replicas,
            ray_address=ray_address,
            cpus_per_replica=cpus_per_replica,
            gpus_per_replica=gpus_per_replica,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            corpora_per_replica=corpora_per_replica,
            spill_after_s=spill_after_s,
        )
        app = None if scale.replicas else create_app(api_settings, cag_settings)
    except CagError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    if host not in LOOPBACK and not api_settings.keys:
        typer.echo(f"warning: serving on {host} without CAG_API_KEYS: anyone who can reach it can query and refresh",
                   err=True)
    if scale.replicas:  # Ray is imported only here: plain `cag serve` runs without it
        from cag.cli.serve_ray import serve_on_ray

        serve_on_ray(host, port, api_settings, cag_settings, scale, log_level)
        return
    page = f"; chat page at http://{host}:{port}/" if api_settings.ui else ""
    typer.echo(
        f"cag: serving on http://{host}:{port} (model loads in the background; GET /health turns 200 when ready{page})",
        err=True,
    )
    assert app is not None  # built above but for --replicas
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
