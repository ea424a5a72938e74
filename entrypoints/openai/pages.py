"""The web pages: the playground at ``/`` and the dashboard at ``/dashboard``, with their scripts
and style sheet under ``/web/``. Static files shipped in the package (``entrypoints/openai/web/``),
plain HTML, CSS and JavaScript with no build step and nothing fetched from elsewhere.

The pages are public: they hold no data. Everything they show comes from the API routes, which
need the key like any client does; with ``--api-key`` the pages ask for it, keep it in the tab's
``sessionStorage`` and send it as an ``Authorization`` header (never in a URL). Every page answer
carries a Content-Security-Policy that allows scripts, styles and connections of this origin only
(no inline script, no ``unsafe-inline``), and media from this origin or ``blob:`` URLs (results are
fetched with the key and shown from a blob).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from .body import BodyRoute
from .protocol import ApiError

router = APIRouter(route_class=BodyRoute)

WEB_DIR = Path(__file__).with_name("web")

#: The policy of every page and asset.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' blob: data:; media-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
#: The files served under /web/, and their media types: nothing else in the folder is reachable.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "realtime.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}


def _file(name: str, media_type: str) -> Response:
    return Response((WEB_DIR / name).read_bytes(), media_type=media_type, headers=HEADERS)


@router.get("/", include_in_schema=False)
async def playground() -> Response:
    return _file("index.html", "text/html; charset=utf-8")


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return _file("dashboard.html", "text/html; charset=utf-8")


@router.get("/web/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise ApiError(404, f"no page asset {name!r}", code="not_found")
    return _file(name, media_type)
