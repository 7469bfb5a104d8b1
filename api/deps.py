"""Annotated dependencies: the app's Service, and the Service once the model is ready (503 before)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .service import Service


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


async def ready_service(svc: ServiceDep) -> Service:
    svc.require_ready()
    return svc


ReadyService = Annotated[Service, Depends(ready_service)]
