"""`cag serve`: the HTTP API (REST + OpenAI-compatible) under uvicorn."""

from __future__ import annotations

from typing import Annotated

import typer

from cag.config import get_settings
from cag.errors import CagError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def serve(
    host: Annotated[str, typer.Option(help="Interface to bind; loopback by default. Anything else should set CAG_API_KEYS.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    model: Annotated[str | None, typer.Option("--model", help="Model: the embedded default, a Hugging Face folder or hub id. Env: CAG_MODEL.")] = None,
    workers: Annotated[int | None, typer.Option(help="Generations running at once (default 2). Env: CAG_WORKERS; torch threads of each: CAG_THREADS.")] = None,
    max_queue: Annotated[int | None, typer.Option(help="Requests that may wait for a worker; more get 429. Env: CAG_MAX_QUEUE.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Per-request timeout in seconds. Env: CAG_REQUEST_TIMEOUT_S.")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level: critical, error, warning, info, debug.")] = "info",
    store: Annotated[str | None, typer.Option("--store", help="Shared snapshot store, s3://bucket/prefix (default: CAG_HOME only). Env: CAG_STORE.")] = None,
):
    """Serve the knowledge API: POST /v1/ask, the OpenAI-compatible /v1/chat/completions and /v1/models,
    corpora and refresh jobs, /health, /metrics, docs at /docs. API keys come from CAG_API_KEYS
    (comma-separated), never from the command line."""
    import uvicorn

    from cag.api.app import create_app
    from cag.api.settings import load_api_settings

    try:  # a bad setting (CAG_API_KEYS=" , ", CAG_WORKERS=0 ...) is one line and exit 1, never an open server
        api_settings = load_api_settings(workers=workers, max_queue=max_queue, request_timeout_s=timeout)
        app = create_app(api_settings, get_settings(model=model, store=store))
    except CagError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(e.exit_code) from None
    if host not in LOOPBACK and not api_settings.keys:
        typer.echo(f"warning: serving on {host} without CAG_API_KEYS: anyone who can reach it can query and refresh",
                   err=True)
    typer.echo(f"cag: serving on http://{host}:{port} (model loads in the background; GET /health turns 200 when ready)",
               err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
