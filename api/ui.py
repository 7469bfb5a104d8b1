"""The chat page: a few static files shipped as package data (api/static/), served at `/` and
`/ui/<file>`. No build step, no CDN, no inline script: the page's own script and style, and two
libraries vendored from npm unchanged (api/static/vendor/README.md): marked renders answers as
markdown, DOMPurify sanitizes what it made.

The page and its files are open (a browser cannot send a bearer key when it navigates); they hold
no data. Everything the page shows comes from the API with the key the user types, which the page
keeps in the tab's memory. `CAG_UI=false` or `cag serve --no-ui` leave these routes out (404 at /).

Every file is sent with a Content-Security-Policy that allows scripts, styles and connections to
this origin only (no inline script, no eval, no plugins, no framing) and `nosniff`: a document or
answer that holds `<script>` or `<img onerror=...>` cannot run, even if text were ever turned into
HTML by mistake. The page renders names, file names, questions and errors with textContent only;
answers go through marked (raw HTML in them is shown as text) and then DOMPurify's allow-list.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from cag.errors import NotFound

# name -> media type; nothing else is served (no paths from the request reach the file system)
FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
    "vendor/marked.umd.js": "text/javascript; charset=utf-8",
    "vendor/purify.min.js": "text/javascript; charset=utf-8",
}

CSP = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
))

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server serves its own page
}

router = APIRouter(include_in_schema=False)


def read(name: str) -> bytes:
    return resources.files("cag.api").joinpath("static", *name.split("/")).read_bytes()


def _file(name: str) -> Response:
    if name not in FILES:
        raise NotFound(f"no such file {name!r} in the chat page")
    return Response(read(name), media_type=FILES[name], headers=HEADERS)


@router.get("/")
def page() -> Response:
    return _file("index.html")


@router.get("/ui/{name:path}")
def asset(name: str) -> Response:
    return _file(name)  # only FILES' keys: `..`, `%2f` and the like name nothing there
