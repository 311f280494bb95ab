"""The UI inside a Django project, behind Django's own authentication: staff
users only, Django's CSRF protection on the actions, the Django user's name
in the audit trail.

    # urls.py
    path("everystep/", include("everystep.ui.django_urls")),

The database is `settings.EVERYSTEP_UI_DATABASE_URL`, else the environment's
EVERYSTEP_DATABASE_URL. Needs django.contrib.auth and the session, CSRF and
authentication middleware (a default project has them).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.middleware.csrf import get_token
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_POST

from everystep import serde, streams
from everystep.ui.core import Console, Problem, Who, to_json
from everystep.ui.web import HEARTBEAT_SECONDS, HERE

app_name = "everystep-ui"
_templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
_console: Console | None = None
_console_lock = threading.Lock()


def console() -> Console:
    """The process's one console (one pool, one live hub), made on first use."""
    global _console
    with _console_lock:
        if _console is None:
            url = getattr(settings, "EVERYSTEP_UI_DATABASE_URL", None) or os.environ.get("EVERYSTEP_DATABASE_URL")
            if not url:
                raise RuntimeError("set EVERYSTEP_UI_DATABASE_URL in the Django settings (or EVERYSTEP_DATABASE_URL)")
            _console = Console(url)
        return _console


def staff_only(view: Callable) -> Callable:
    """Active staff users; others are sent to log in, or refused when logged in."""
    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        user = request.user
        if not user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not (user.is_active and user.is_staff):
            return _json({"error": "staff only"}, 403)
        try:
            return view(request, Who("operator", user.get_username()), *args, **kwargs)
        except Problem as problem:
            return _json({"error": str(problem)}, problem.status)
    return wrapped


def _json(data: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(to_json(data), status=status, content_type="application/json")


def _base() -> str:
    return reverse(f"{app_name}:page").rstrip("/")


@require_GET
@staff_only
def page(request: HttpRequest, who: Who, run_id: str | None = None) -> HttpResponse:
    html = _templates.get_template("index.html").render(
        role=who.role, csrf_header="X-CSRFToken", csrf_token=get_token(request), base=_base(),
        static_base=_base() + "/static", login=False, user=who.name, environment=console().environment(),
    )
    return HttpResponse(html)


@require_GET
@staff_only
def static(request: HttpRequest, who: Who, name: str) -> FileResponse:
    files = {f.name: f for f in (HERE / "static").iterdir()}
    if name not in files:
        raise Http404(name)
    return FileResponse(open(files[name], "rb"))


def _read(method: Callable[..., dict], with_query: bool = False) -> Callable:
    @require_GET
    @staff_only
    def view(request: HttpRequest, who: Who, **kwargs: Any) -> HttpResponse:
        args = [request.GET.dict()] if with_query else []
        return _json(method(console())(*args, *kwargs.values()))
    return view


@require_POST
@staff_only
def act(request: HttpRequest, who: Who, action: str) -> HttpResponse:
    """Django's CSRF middleware has checked the token before this runs."""
    try:
        body = json.loads(request.body or b"{}")
    except ValueError:
        raise Problem(400, "the request body must be JSON") from None
    return _json(console().act(who, action, body))


@require_GET
@staff_only
def events(request: HttpRequest, who: Who) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_stream(console()), content_type="text/event-stream")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


@require_GET
@staff_only
def stream(request: HttpRequest, who: Who, run_id: str, key: str) -> StreamingHttpResponse:
    """A run's durable stream as Server-Sent Events (see docs/streams.md)."""
    c = console()
    run, key, offset = c.stream_start(run_id, key, request.headers.get("Last-Event-ID"), request.GET.get("offset"))
    response = StreamingHttpResponse(_stream_entries(c.database_url, run, key, offset),
                                     content_type="text/event-stream")
    response["Cache-Control"] = "no-store"
    response["X-Accel-Buffering"] = "no"
    return response


def _stream_entries(database_url: str, run: Any, key: str, offset: int) -> Iterator[str]:
    """As everystep.ui.web's, for a synchronous server: one thread per open response."""
    while True:
        try:
            for entry in streams.read_stream(run, key, offset=offset, timeout=HEARTBEAT_SECONDS, conn=database_url):
                yield f"id: {entry.offset}\ndata: {serde.dumps(entry.value)}\n\n"
                offset = entry.offset + 1
            yield "event: end\ndata: {}\n\n"
            return
        except TimeoutError:
            yield ": heartbeat\n\n"


def _stream(c: Console) -> Iterator[str]:
    """Server-Sent Events for a synchronous server: one thread per open page
    waits on the hub (which still polls the database once for all of them)."""
    stop = c.hub.listen(lambda: None)
    try:
        version, snapshot = c.hub.latest()
        yield f"id: {version}\nevent: overview\ndata: {to_json({'version': version, **snapshot})}\n\n"
        while True:
            new_version, snapshot = c.hub.wait(version, HEARTBEAT_SECONDS)
            if new_version == version:
                yield ": heartbeat\n\n"
                continue
            version = new_version
            yield f"id: {version}\nevent: overview\ndata: {to_json({'version': version, **snapshot})}\n\n"
    finally:
        stop()


urlpatterns = [
    path("", page, name="page"),
    path("runs/<str:run_id>", page),
    path("static/<str:name>", static),
    path("api/overview", _read(lambda c: c.overview)),
    path("api/runs", _read(lambda c: c.runs, with_query=True)),
    path("api/runs/<str:run_id>", _read(lambda c: c.run)),
    path("api/workflows", _read(lambda c: c.workflows)),
    path("api/schedules", _read(lambda c: c.schedules)),
    path("api/workers", _read(lambda c: c.workers)),
    path("api/failures", _read(lambda c: c.failures, with_query=True)),
    path("api/audit", _read(lambda c: c.audit, with_query=True)),
    path("api/charts", _read(lambda c: c.charts, with_query=True)),
    path("api/schedules/<str:key>/fires", _read(lambda c: c.schedule_fires)),
    path("api/events", events),
    path("api/runs/<str:run_id>/streams/<path:key>", stream),
    path("api/actions/<str:action>", act),
]
