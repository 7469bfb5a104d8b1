"""Bearer API keys as a FastAPI security dependency: the routes that carry it need a key, and the
OpenAPI description says so (security scheme `bearer`, a 401 response) because it is declared there.

Keys are compared as SHA-256 digests (equal lengths, so `compare_digest` leaks nothing) against
every configured key without an early exit: the time spent does not depend on which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import Unauthorized

bearer = HTTPBearer(auto_error=False, scheme_name="bearer", description="One of CAG_API_KEYS.")


class RequireKey:
    """A dependency that raises Unauthorized (401) unless `Authorization: Bearer <one of keys>`."""

    def __init__(self, keys: list[str]):
        if not keys:
            raise ValueError("RequireKey needs at least one key")
        self.digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    async def __call__(self, request: Request,
                       credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]) -> None:
        token = credentials.credentials.strip() if credentials else ""
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for key in self.digests:
            ok |= hmac.compare_digest(digest, key)
        if not (ok and token):
            raise Unauthorized("missing or invalid API key: send `Authorization: Bearer <key>`")
        request.state.key_scope = scope_of(digest)


def scope_of(digest: bytes) -> str:
    """What keeps one key's conversations apart from another's (cag.runtime.kept_conversations): a name
    derived from the key's digest, never the key."""
    return hashlib.sha256(b"cag-scope:" + digest).hexdigest()[:16]


def key_scope(request: Request) -> str | None:
    """The scope of the request's API key; None without CAG_API_KEYS (one user: one scope)."""
    return getattr(request.state, "key_scope", None)
