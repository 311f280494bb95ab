"""The UI as an ASGI application (Starlette; Jinja2 for the one page; served
by uvicorn, see `everystep.ui.server`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from everystep.ui.core import Console, Problem, Who, to_json
from everystep.ui.tails import Tails

HERE = Path(__file__).parent
COOKIE = "everystep_ui_token"
HEARTBEAT_SECONDS = 15.0
templates = Jinja2Templates(directory=str(HERE / "templates"))


class _JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return to_json(content).encode()


def _token(request: Request) -> tuple[str | None, bool]:
    """The credential of a request, and whether it came in a header (a
    script's, which no other site can make a browser send)."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip(), True
    return request.cookies.get(COOKIE), False


def _base(request: Request) -> str:
    """The path the app is mounted at, without the trailing slash."""
    return request.scope.get("root_path", "").rstrip("/")


def create_app(console: Console) -> Starlette:
    """The ASGI app of one console: the page, its JSON API, its event stream."""
    credentials = console.credentials
    tails = Tails(console.database_url, HEARTBEAT_SECONDS)  # one reader per stream, for all its clients

    def identify(request: Request) -> Who | None:
        peer = request.client.host if request.client else None
        return credentials.identify(_token(request)[0], peer, request.headers)

    def who(request: Request) -> Who:
        found = identify(request)
        if found is None:
            raise Problem(401, "a viewer or operator token is needed")
        return found

    def api(method: Callable[..., Any], with_query: bool = False) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                who(request)
                args = [dict(request.query_params)] if with_query else []
                args += list(request.path_params.values())
                return _JSON(await run_in_threadpool(method, *args))
            except Problem as problem:
                return _JSON({"error": str(problem)}, status_code=problem.status)
        return endpoint

    async def page(request: Request) -> Response:
        caller = identify(request)
        if caller is None:
            return RedirectResponse(request.url_for("login"), status_code=303)
        environment = await run_in_threadpool(console.environment)
        return templates.TemplateResponse(request, "index.html", {
            "role": caller.role, "csrf_header": "X-CSRF-Token", "csrf_token": credentials.csrf_token(caller),
            "base": _base(request), "static_base": _base(request) + "/static",
            "login": credentials.required and not caller.session.startswith("header:"),
            "user": caller.name, "environment": environment,
        })

    async def login(request: Request) -> Response:
        failed = False
        if request.method == "POST":
            form = await request.form()
            token = str(form.get("token", ""))
            if credentials.identify(token) is not None:
                response = RedirectResponse(request.url_for("page"), status_code=303)
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/",
                                    secure=request.url.scheme == "https")
                return response
            failed = True
        return templates.TemplateResponse(request, "login.html",
                                          {"failed": failed, "static_base": _base(request) + "/static"},
                                          status_code=401 if failed else 200)

    async def logout(request: Request) -> Response:
        response = RedirectResponse(request.url_for("login"), status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def act(request: Request) -> Response:
        from_header = _token(request)[1]
        try:
            caller = who(request)
            # A browser session's POST must carry the page's CSRF token; a
            # script's bearer header cannot be forged by another site.
            if not from_header and not credentials.csrf_ok(caller, request.headers.get("x-csrf-token")):
                raise Problem(403, "CSRF token missing or wrong: reload the page")
            try:
                body = json.loads(await request.body() or b"{}")
            except ValueError:
                raise Problem(400, "the request body must be JSON") from None
            answer = await run_in_threadpool(console.act, caller, request.path_params["action"], body)
            return _JSON(answer)
        except Problem as problem:
            return _JSON({"error": str(problem)}, status_code=problem.status)

    async def me(request: Request) -> Response:
        """Who the server takes the caller for, and the database's environment."""
        try:
            caller = who(request)
        except Problem as problem:
            return _JSON({"error": str(problem)}, status_code=problem.status)
        environment = await run_in_threadpool(console.environment)
        return _JSON({"name": caller.name, "role": caller.role, "environment": environment})

    async def events(request: Request) -> Response:
        try:
            who(request)
        except Problem as problem:
            return _JSON({"error": str(problem)}, status_code=problem.status)
        return StreamingResponse(_stream(console), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def stream(request: Request) -> Response:
        """A run's stream as Server-Sent Events (`id:` the offset)."""
        try:
            who(request)
            run, key, offset = await run_in_threadpool(
                console.stream_start, request.path_params["run_id"], request.path_params["key"],
                request.headers.get("last-event-id"), request.query_params.get("offset"))
        except Problem as problem:
            return _JSON({"error": str(problem)}, status_code=problem.status)
        return StreamingResponse(tails.events(run, key, offset),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    routes = [
        Route("/", page, name="page"),
        Route("/runs/{run_id}", page),
        Route("/login", login, methods=["GET", "POST"], name="login"),
        Route("/logout", logout, methods=["POST"]),
        Route("/api/overview", api(console.overview)),
        Route("/api/me", me),
        Route("/api/runs", api(console.runs, with_query=True)),
        Route("/api/runs/{run_id}", api(console.run)),
        Route("/api/runs/{run_id}/streams/{key:path}", stream),
        Route("/api/dags", api(console.dags, with_query=True)),
        Route("/api/dags/{key:path}", api(console.dag)),
        Route("/api/workflows", api(console.workflows)),
        Route("/api/schedules", api(console.schedules)),
        Route("/api/workers", api(console.workers)),
        Route("/api/failures", api(console.failures, with_query=True)),
        Route("/api/audit", api(console.audit, with_query=True)),
        Route("/api/charts", api(console.charts, with_query=True)),
        Route("/api/schedules/{key}/fires", api(console.schedule_fires)),
        Route("/api/events", events),
        Route("/api/actions/{action}", act, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(routes=routes)


async def _stream(console: Console) -> AsyncIterator[str]:
    """Server-Sent Events: the hub's snapshot now and after every change, a
    comment line as heartbeat. Woken from the hub's thread."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()
    stop = console.hub.listen(lambda: loop.call_soon_threadsafe(changed.set))
    try:
        version, snapshot = await run_in_threadpool(console.hub.latest)
        yield f"id: {version}\nevent: overview\ndata: {to_json({'version': version, **snapshot})}\n\n"
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), HEARTBEAT_SECONDS)
            if not changed.is_set():
                yield ": heartbeat\n\n"
                continue
            changed.clear()
            if console.hub.version != version:
                version, snapshot = console.hub.current()
                yield f"id: {version}\nevent: overview\ndata: {to_json({'version': version, **snapshot})}\n\n"
    finally:
        stop()

