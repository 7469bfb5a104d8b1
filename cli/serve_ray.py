"""`cag serve --replicas N`: deploy the API on Ray Serve (cag.api.ray_app) and stay attached.

Without --ray-address (and RAY_ADDRESS unset) a local Ray instance is started and torn down with the
command. With one, the command joins that cluster as a driver, deploys the "cag" application and
deletes it again on exit (Ctrl-C or SIGTERM), leaving Ray and Serve running for others: either way
the command owns the service's lifetime, as plain `cag serve` does.
"""

from __future__ import annotations

import os
import signal
import time

import typer

from cag.api.replica_settings import ReplicaSettings
from cag.api.settings import ApiSettings
from cag.config import Settings


def _stop(signum, frame):
    raise KeyboardInterrupt  # SIGTERM tears down like Ctrl-C


def serve_on_ray(host: str, port: int, api: ApiSettings, cag: Settings, rs: ReplicaSettings, log_level: str) -> None:
    try:
        import ray
        from ray import serve

        from cag.api.ray_app import APP, application
    except ImportError as e:
        typer.echo(f"error: --replicas needs Ray Serve ({e}); install it with pip install 'cag[ray]'", err=True)
        raise typer.Exit(1) from None
    joined = bool(rs.ray_address or os.environ.get("RAY_ADDRESS"))
    if joined and not cag.store:
        typer.echo("warning: no CAG_STORE: replicas on other machines will not see this machine's snapshots", err=True)
    signal.signal(signal.SIGTERM, _stop)
    try:
        ray.init(address=rs.ray_address, include_dashboard=False if not joined else None,
                 logging_level=log_level.upper(),  # type: ignore[arg-type]  # Ray hands it to logging, which takes names
                 log_to_driver=log_level.lower() in ("info", "debug"))
    except ConnectionError as e:  # a wrong address or token: one line, like every other start-up error
        typer.echo(f"error: cannot join the Ray cluster: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < rs.replicas * rs.cpus_per_replica:
            typer.echo(f"warning: the cluster has {cpus:g} CPUs; {rs.replicas} replicas x {rs.cpus_per_replica:g} "
                       "will not all start (lower --cpus-per-replica or add nodes)", err=True)
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": log_level.upper()})
        typer.echo(
            f"cag: deploying {rs.replicas} engine replica(s) on Ray "
            f"Serve{' at ' + rs.ray_address if rs.ray_address else ''}; serving on http://{host}:{port} (GET /health "
            "turns 200 when the ingress and a replica are ready)",
            err=True,
        )
        serve.run(application(api, cag, rs), name=APP, route_prefix="/", blocking=False)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        typer.echo("cag: stopping", err=True)
        try:
            if joined:
                serve.delete(APP)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
