"""What the UI does, independent of the web framework serving it: reading
runs for the pages, the actions (each audited), and who may do what.

Both front ends (the Starlette app of `everystep ui` and the supervisor, and
the Django views) call `Console`; they only translate requests and answers.
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from everystep import attributes as run_attributes
from everystep import dags, db, liveness, operations, serde, streams
from everystep.errors import EverystepError
from everystep.logs import first_line
from everystep.ui.hub import Hub

log = logging.getLogger("everystep")

STATUSES = ("scheduled", "waiting", "running", "blocked", "completed", "failed", "stopped", "cancelled")
PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
BULK_LIMIT = 10_000  # runs one bulk action on a filter may touch
STATEMENT_TIMEOUT_MS = 5000
FAILURE_WINDOWS = {"hour": 1, "day": 24, "week": 24 * 7}
ENVIRONMENT_TTL = 30.0  # seconds the header's environment is kept before it is read again
CHART_WINDOWS = {"hour": 60, "day": 24 * 60}  # minutes
STEP_DURATION_RUNS = 1000  # the step duration chart reads the steps of this many newest runs
SCHEDULE_FIRES = 100
ARGS_SEARCH_WINDOWS = (dt.timedelta(hours=1), dt.timedelta(days=1), dt.timedelta(days=7), None)


class Problem(Exception):
    """An answer other than success: an HTTP status and one line for the operator."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Who:
    """The caller, as the server established it (never as the client says)."""

    role: str  # viewer or operator
    name: str  # what the audit trail records
    session: str = ""  # what the CSRF token is bound to (the credential); empty: the name

    @property
    def can_act(self) -> bool:
        return self.role == "operator"


# ---------------------------------------------------------------- credentials

MAX_HEADER_USER = 255  # the width of everystep_audit.actor


class Credentials:
    """Who may read and who may act: the two shared tokens (the audit trail
    names their holders "viewer" and "operator"), per-person tokens
    (`ui.users`), and the user a trusted authenticating proxy names in a
    header; and the CSRF tokens derived from them. With none configured
    every caller is an operator: only allowed on a loopback address (see
    `check_bind`)."""

    def __init__(self, viewer_token: str = "", operator_token: str = "", users: Mapping[str, Any] | None = None,
                 trusted_user_header: str = "", trusted_proxies: tuple[str, ...] = (),
                 trusted_user_role: str = "viewer"):
        import ipaddress  # noqa: PLC0415

        self.viewer_token = viewer_token
        self.operator_token = operator_token
        self.users = dict(users or {})  # name -> an object with .token and .role (config.UiUser)
        # Every token, in one list, all compared on every request.
        self._tokens = [(t.encode(), Who(role, name, t)) for t, role, name in (
            (viewer_token, "viewer", "viewer"), (operator_token, "operator", "operator"),
            *((u.token, u.role, name) for name, u in self.users.items())) if t]
        self.trusted_user_header = trusted_user_header.lower()
        self._proxies = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]
        self.trusted_user_role = trusted_user_role
        self._secret = secrets.token_bytes(32)  # CSRF tokens are valid for this server's life

    @classmethod
    def from_config(cls, ui: Any) -> Credentials:
        """The credentials of a `ui:` section (config.UiConfig)."""
        return cls(ui.viewer_token, ui.operator_token, ui.users, ui.trusted_user_header, ui.trusted_proxies,
                   ui.trusted_user_role)

    @property
    def required(self) -> bool:
        return bool(self._tokens or self.trusted_user_header)

    def identify(self, token: str | None, peer: str | None = None,
                 headers: Mapping[str, str] | None = None) -> Who | None:
        """Who holds `token`, or who the trusted proxy at `peer` names in its
        header; None when neither is one of ours. Every token is compared,
        in constant time. The header counts only from a trusted proxy's
        address: from anywhere else it is ignored."""
        if not self.required:
            return Who("operator", "local")
        if self.trusted_user_header and headers is not None and self._trusted(peer):
            named = (headers.get(self.trusted_user_header) or "").strip()
            if named:
                return self._header_user(named)
        given = (token or "").encode()
        found = None
        for known, who in self._tokens:
            if hmac.compare_digest(given, known) and found is None:
                found = who
        return found

    def _trusted(self, peer: str | None) -> bool:
        import ipaddress  # noqa: PLC0415

        try:
            address = ipaddress.ip_address(peer or "")
        except ValueError:
            return False
        return any(address in network for network in self._proxies)

    def _header_user(self, name: str) -> Who | None:
        if len(name) > MAX_HEADER_USER or not name.isprintable():
            return None
        user = self.users.get(name)
        role = user.role if user is not None else self.trusted_user_role
        if role not in ("viewer", "operator"):
            return None  # trusted_user_role: none, and not a listed user
        return Who(role, name, f"header:{name}")

    def csrf_token(self, who: Who | None) -> str:
        """The CSRF token of a session: bound to its credential and this server."""
        key = (who.session or who.name) if who is not None else "local"
        return hmac.new(self._secret, key.encode(), "sha256").hexdigest()

    def csrf_ok(self, who: Who, given: str | None) -> bool:
        return hmac.compare_digest(self.csrf_token(who).encode(), (given or "").encode())


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(bind: str) -> bool:
    import ipaddress  # noqa: PLC0415

    if bind in LOOPBACK_NAMES or bind.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def bind_problem(bind: str, viewer_token: str, operator_token: str,
                 how: str = "set ui.viewer_token and/or ui.operator_token (e.g. ${EVERYSTEP_UI_OPERATOR_TOKEN}), "
                            "ui.users or ui.trusted_user_header",
                 others: bool = False) -> str | None:
    """Why the UI may not serve on `bind` with these credentials (`others`:
    per-person ones, or a trusted header), or None."""
    if is_loopback(bind) or viewer_token or operator_token or others:
        return None
    return f"bind {bind!r} is not a loopback address and no credentials are configured: {how}, or bind 127.0.0.1"


# ---------------------------------------------------------------- values

def plain(value: Any) -> Any:
    """json.dumps default: ids and times as text."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")
    raise TypeError(f"cannot send a {type(value).__name__} as JSON")


def to_json(data: Any) -> str:
    return json.dumps(data, default=plain, ensure_ascii=False, separators=(",", ":"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _value(text: Any, what: str) -> Any:
    """A value typed by the operator in everystep's extended JSON."""
    if not isinstance(text, str):
        raise Problem(400, f"{what} must be JSON text")
    try:
        return serde.from_json(json.loads(text, parse_constant=_reject_constant))
    except Exception as exc:  # bad JSON or a malformed tagged value: bad input either way
        raise Problem(400, f"{what} is not a valid everystep JSON value: {first_line(exc)}") from None


def _run_id(text: Any) -> uuid.UUID:
    try:
        return uuid.UUID(str(text))
    except ValueError:
        raise Problem(400, f"{str(text)[:60]!r} is not a run id (a run id is a UUID)") from None


def _time(text: str | None, what: str) -> dt.datetime | None:
    if not text:
        return None
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise Problem(400, f"{what}: {text[:40]!r} is not an ISO time like 2026-01-02T03:04") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.UTC)


def run_filter(query: Mapping[str, str]) -> db.RunFilter:
    """The list's filter from query parameters; a bad one is a 400."""
    status = query.get("status") or None
    if status is not None and status not in STATUSES:
        raise Problem(400, f"status must be one of {', '.join(STATUSES)}, not {status[:30]!r}")
    search = (query.get("q") or "").strip()
    run_id = key = args = None
    if search.startswith(("{", "[")):
        try:
            json.loads(search, parse_constant=_reject_constant)
        except ValueError as exc:
            raise Problem(400, f"args search must be JSON (containment, e.g. {{\"name\": \"vm-1\"}}): {exc}") \
                from None
        args = search
    elif search:
        try:
            run_id = uuid.UUID(search)
        except ValueError:
            key = search  # neither JSON nor an id: an idempotency key
    before = None
    if query.get("before"):
        at, _, last = query["before"].partition("|")
        moment = _time(at, "before")
        before = (moment, _run_id(last))
    since, until = _time(query.get("since"), "since"), _time(query.get("until"), "until")
    if since is not None and until is not None and until <= since:
        raise Problem(400, f"until ({plain(until)}) must be after since ({plain(since)})")
    attributes = attribute_filter(query.get("attr"))
    return db.RunFilter(status=status, workflow=query.get("workflow") or None, since=since, until=until,
                        run_id=run_id, idempotency_key=key, args_contain=args, before=before,
                        attributes_contain=None if attributes is None else json.dumps(attributes))


def attribute_filter(text: str | None) -> dict | None:
    """The list's attribute filter, `attr` in the URL: `tenant=acme,order=42`
    (each value read as the command line's --where reads it), or a JSON
    object; a bad one is a 400."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        if text.startswith("{"):
            given = json.loads(text, parse_constant=_reject_constant)
        else:
            given = dict(run_attributes.parse_where(pair) for pair in text.split(",") if pair.strip())
        run_attributes.run_filter("attr", attributes=given)
    except (ValueError, EverystepError) as exc:
        raise Problem(400, f"attr: {first_line(exc)} (e.g. tenant=acme,order=42)") from None
    return given


def _limit(query: Mapping[str, str]) -> int:
    text = query.get("limit") or str(PAGE_SIZE)
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE_SIZE:
        raise Problem(400, f"limit must be a whole number from 1 to {MAX_PAGE_SIZE}")
    return int(text)


def counts_shown(overview: dict) -> dict:
    """Per status: {"n": number, "exact": bool}. Exact up to the cap, else the
    planner's estimate (never below the cap), from statistics, not a scan."""
    estimate = overview.get("estimate") or {}
    freqs = dict(zip(estimate.get("values") or [], estimate.get("freqs") or []))
    rows = estimate.get("rows") or 0
    shown = {}
    for status, n in (overview.get("counts") or {}).items():
        if n <= db.UI_STATUS_CAP:
            shown[status] = {"n": n, "exact": True}
        else:
            shown[status] = {"n": max(db.UI_STATUS_CAP + 1, math.floor(rows * freqs.get(status, 0))),
                             "exact": False}
    return shown


EXECUTION_ENDS = {
    "drained": "requeued by a drain (its worker stopped)",
    "swept": "requeued by the dead-claimer sweep (its claimer died)",
    "escaped": "requeued: its execution escaped its worker (counted as a crash)",
    "requeued": "requeued by an operator (its claimer was dead)",
    "crashed": "its worker crashed; claimed again by the worker's next incarnation",
    "lost": "lost claim: the claim's answer never reached its worker; claimed again",
    "shutdown": "requeued at its worker's shutdown",
    "unknown": "given back: its worker cannot import the workflow (the run waits for a worker that can)",
}


def execution_history(run: dict) -> list[dict]:
    """Every execution of a run (each claim, by execution token), oldest
    first: who held it, its first and last step, and how it ended. The
    executions that ended other than by the run ending or parking are
    recorded (everystep_execution); the one holding the run, or the last,
    is the run row's (claimed_by, claim_token); the others are known from
    the steps they recorded, and ended by parking the run (a sleep, a wait,
    a retry's back-off) or by blocking it."""
    by_token: dict[Any, dict] = {}

    def entry(token: Any) -> dict:
        return by_token.setdefault(token, {"token": token, "claimer": None, "first_step_at": None,
                                           "last_step_at": None, "steps": 0, "ended_at": None, "outcome": None,
                                           "how": None})

    for step in run.get("steps") or []:
        token = step.get("claim_token")
        if token is None:
            continue
        each = entry(token)
        each["steps"] += 1
        started, finished = step.get("started_at"), step.get("finished_at") or step.get("started_at")
        if started and (each["first_step_at"] is None or started < each["first_step_at"]):
            each["first_step_at"] = started
        if finished and (each["last_step_at"] is None or finished > each["last_step_at"]):
            each["last_step_at"] = finished
    for row in run.get("executions") or []:
        each = entry(row["token"])
        each.update(claimer=row["claimer"], ended_at=row["ended_at"], outcome=row["outcome"],
                    how=EXECUTION_ENDS.get(row["outcome"], row["outcome"]))
    current = run.get("claim_token")
    if current is not None and entry(current)["outcome"] is None:
        each = entry(current)
        each["claimer"] = run.get("claimed_by")
        status = run["status"]
        if status == "running":
            each.update(outcome="running", how="running now")
        elif status == "waiting":
            each.update(outcome="parked", how=f"parked the run (waiting for {run.get('waiting_on') or 'its time'})")
        elif status == "blocked":
            each.update(outcome="blocked", how="blocked on an unsafe step whose outcome is unknown")
        elif status == "scheduled":
            each.update(outcome="parked", how="ended; the run is scheduled again")
        else:
            each.update(outcome=status, how=f"the run ended {status}", ended_at=run.get("completed_at"))
    for each in by_token.values():
        if each["outcome"] is None:
            each.update(outcome="parked", how="parked the run (a sleep, a wait or a retry's back-off), or blocked it")
    return [by_token[token] for token in sorted(by_token)]


# ---------------------------------------------------------------- the console

class Console:
    """The UI's reads and actions on one database (a small pool), and the
    live hub that polls it for every open page."""

    def __init__(self, database_url: str, credentials: Credentials | None = None, pool_size: int = 4,
                 poll_interval: float = 1.0):
        self.credentials = credentials or Credentials()
        self.database_url = database_url  # a stream's reader opens its own connection (it LISTENs)
        self.pool = ConnectionPool(
            database_url, min_size=1, max_size=pool_size, open=True, name="everystep-ui",
            kwargs=liveness.connection_kwargs("everystep ui"), configure=self._configure,
        )
        self.hub = Hub(self._overview, interval=poll_interval)
        self._environment: tuple[str | None, float] | None = None  # (name, when read)

    @staticmethod
    def _configure(conn: psycopg.Connection) -> None:
        db.set_statement_timeout(conn, STATEMENT_TIMEOUT_MS)

    def close(self) -> None:
        self.hub.close()
        self.pool.close()

    def _db(self):
        return self.pool.connection(timeout=10)

    # ------------------------------------------------------------ reads

    def _overview(self) -> dict:
        with self._db() as conn:
            overview = db.ui_overview(conn, STATUSES, PAGE_SIZE)
        overview["counts"] = counts_shown(overview)
        overview.pop("estimate")
        return overview

    def overview(self) -> dict:
        version, snapshot = self.hub.latest()
        return {"version": version, **snapshot}

    def runs(self, query: Mapping[str, str]) -> dict:
        limit = _limit(query)
        f = run_filter(query)
        with self._db() as conn:
            if f.args_contain is None or f.since is not None:
                rows = db.ui_runs(conn, f, limit + 1)
            else:
                # No index serves args containment: look in the newest hour
                # first, then wider, so a common match never scans the table.
                now = db.database_now(conn)
                for window in ARGS_SEARCH_WINDOWS:
                    since = None if window is None else now - window
                    rows = db.ui_runs(conn, f._replace(since=since), limit + 1)
                    if len(rows) > limit:
                        break
        more = len(rows) > limit
        rows = rows[:limit]
        after = f"{plain(rows[-1]['created_at'])}|{rows[-1]['id']}" if more else None
        return {"runs": rows, "next": after}

    def run(self, run_id: str) -> dict:
        run = _run_id(run_id)
        with self._db() as conn:
            found = db.ui_run(conn, run)
            if found is not None and found["status"] == "running" and found["claimed_by"]:
                # The requeue button only when the claimer's lock is free (it is dead).
                found["claimer_alive"] = not db.runners_without_lock(conn, [found["claimed_by"]])
            if found is not None:
                found["streams"] = [{"key": key, "entries": entries, "closed": closed or found["status"] in db.TERMINAL}
                                    for key, entries, closed in db.run_streams(conn, run)]
        if found is None:
            raise Problem(404, f"no run {run}")
        found["execution_history"] = execution_history(found)
        with self._db() as conn:
            member = dags.member_of(conn, run)
        found["dag"] = None if member is None else {"key": member[0], "member": member[1]}
        blocked_on = [s["step_id"] for s in found["steps"] if s["status"] == "started"]
        if found["status"] == "blocked" and blocked_on:
            found["resolve"] = {
                "step": blocked_on[0],
                "cli": [f"everystep resolve-step {run} {blocked_on[0]} --result JSON",
                        f"everystep resolve-step {run} {blocked_on[0]} --error MSG",
                        f"everystep resolve-step {run} {blocked_on[0]} --discard"],
            }
        return found

    def stream_start(self, run_id: str, key: str, last_event_id: str | None, offset: str | None) -> tuple:
        """Where a stream's Server-Sent Events start: (run, key, offset), from
        the `Last-Event-ID` of a reconnecting client (the offset after it),
        else `?offset=`, else 0. An unknown run is a 404."""
        run = _run_id(run_id)
        if not 1 <= len(key) <= streams.MAX_STREAM_KEY:
            raise Problem(400, f"a stream key is 1 to {streams.MAX_STREAM_KEY} characters")
        try:
            start = int(last_event_id) + 1 if last_event_id else int(offset or 0)
        except ValueError:
            raise Problem(400, "Last-Event-ID and offset= are offsets (integers >= 0)") from None
        if start < 0:
            raise Problem(400, "Last-Event-ID and offset= are offsets (integers >= 0)")
        with self._db() as conn:
            if db.read_stream(conn, run, key, start, 0).status is None:
                raise Problem(404, f"no run {run}")
        return run, key, start
    def dags(self, query: Mapping[str, str]) -> dict:
        """Graphs of runs, newest first; `status` filters."""
        status = query.get("status") or None
        if status is not None and status not in dags.STATUSES:
            raise Problem(400, f"status must be one of {', '.join(dags.STATUSES)}")
        with self._db() as conn:
            return {"dags": dags.list_dags(conn, status, _limit(query))}

    def dag(self, key: str) -> dict:
        """A graph with its members (status, dependencies, run), in the order they were added."""
        with self._db() as conn:
            try:
                state = dags.get(key, conn=conn)
            except dags.DagNotFound as exc:
                raise Problem(404, str(exc)) from None
        return {"key": state.key, "status": state.status, "created_at": state.created_at,
                "sealed_at": state.sealed_at, "sealed_by": state.sealed_by, "cancelled_at": state.cancelled_at,
                "members": [{"key": k, "run_id": m.run_id, "status": m.status, "depends_on": list(m.depends_on),
                             "cancel_reason": m.cancel_reason} for k, m in state.members.items()]}

    def workflows(self) -> dict:
        with self._db() as conn:
            return {"workflows": db.ui_workflow_names(conn)}

    def schedules(self) -> dict:
        with self._db() as conn:
            try:
                return {"schedules": db.load_schedules(conn)}
            except psycopg.errors.UndefinedTable:
                return {"schedules": []}

    def workers(self) -> dict:
        with self._db() as conn:
            return {"workers": db.ui_workers(conn)}

    def failures(self, query: Mapping[str, str]) -> dict:
        window = query.get("window") or "hour"
        if window not in FAILURE_WINDOWS:
            raise Problem(400, f"window must be one of {', '.join(FAILURE_WINDOWS)}")
        with self._db() as conn:
            return {"window": window, "groups": db.ui_failures(conn, FAILURE_WINDOWS[window])}

    def charts(self, query: Mapping[str, str]) -> dict:
        """The charts over time, of one workflow or all: per minute the runs
        that ended by status, the runs blocked, the backlog and the pickup
        latency (everystep_minute, kept by the maintenance child), and step
        duration percentiles per step name over the newest runs' steps."""
        window = query.get("window") or "hour"
        if window not in CHART_WINDOWS:
            raise Problem(400, f"window must be one of {', '.join(CHART_WINDOWS)}")
        workflow = query.get("workflow") or None
        with self._db() as conn:
            try:
                minutes = db.chart_minutes(conn, workflow, CHART_WINDOWS[window])
            except psycopg.errors.UndefinedTable:
                minutes = []  # a schema before 0015: no figures yet
            now = db.database_now(conn)
            steps = db.chart_step_durations(conn, workflow, STEP_DURATION_RUNS)
        return {"window": window, "workflow": workflow, "now": now, "minutes": minutes, "steps": steps,
                "step_runs": STEP_DURATION_RUNS, "lookback_s": db.CHART_LOOKBACK_S}

    def schedule_fires(self, key: str) -> dict:
        """A schedule's newest fires and how their runs ended."""
        with self._db() as conn:
            return {"key": key, "fires": db.chart_schedule_fires(conn, key, SCHEDULE_FIRES)}

    def audit(self, query: Mapping[str, str]) -> dict:
        """The newest audit records, filtered by person (`actor`), `action`
        and `run` (each exact, when given), paged by record id (`before`)."""
        before = query.get("before")
        if before and not (before.isdigit() and len(before) <= 18):
            raise Problem(400, "before must be an audit record id")
        actor = (query.get("actor") or "").strip() or None
        if actor is not None and len(actor) > MAX_HEADER_USER:
            raise Problem(400, f"actor must be at most {MAX_HEADER_USER} characters")
        action = (query.get("action") or "").strip() or None
        if action is not None and (len(action) > 64 or not all(ch.isalnum() or ch == "-" for ch in action)):
            raise Problem(400, f"action must be an action's name like cancel or resolve-step, not {action[:40]!r}")
        run = _run_id(query["run"]) if query.get("run") else None
        limit = _limit(query)
        with self._db() as conn:
            return {"records": db.audit_records_filtered(conn, actor=actor, action=action, run=run, limit=limit,
                                                         before=int(before) if before else None)}

    def environment(self) -> str | None:
        """The environment the database records (`everystep migrate
        --environment`), read at most every ENVIRONMENT_TTL seconds."""
        now = time.monotonic()
        if self._environment is None or now - self._environment[1] > ENVIRONMENT_TTL:
            try:
                with self._db() as conn:
                    name = db.recorded_environment(conn)
            except psycopg.errors.InsufficientPrivilege:
                name = None  # a role granted before the table existed: the header shows none
            self._environment = (name, now)
        return self._environment[0]

    # ------------------------------------------------------------ actions

    def act(self, who: Who, action: str, body: Any) -> dict:
        """Run an action for `who` (everystep.operations: its audit record is
        written in the same transaction as the change it describes)."""
        if not who.can_act:
            raise Problem(403, "viewers cannot act: an operator token is needed")
        handler = _ACTIONS.get(action)
        if handler is None:
            raise Problem(404, f"no action {action[:40]!r}")
        if not isinstance(body, dict):
            raise Problem(400, "the request body must be a JSON object")
        with self._db() as conn:
            try:
                return handler(self, conn, operations.Actor(who.name, "ui"), body)
            except operations.Refused as refused:
                raise Problem(409, str(refused)) from None

    def _resolve(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        run, step, outcome = _run_id(body.get("run")), body.get("step"), body.get("outcome")
        if not isinstance(step, str) or not step:
            raise Problem(400, "step must be a step id")
        if outcome == "result":
            how = {"result": _value(body.get("value"), "result")}
        elif outcome == "error":
            message = body.get("value")
            if not isinstance(message, str) or not message:
                raise Problem(400, "error must be a message")
            how = {"error": message}
        elif outcome == "discard":
            how = {"discard": True}
        else:
            raise Problem(400, "outcome must be result, error or discard")
        operations.resolve_step(conn, actor, run, step, **how)
        return {"message": f"step {step} of run {run} resolved ({outcome}); the run is scheduled again"}

    def _target_runs(self, conn: psycopg.Connection, body: dict) -> list[uuid.UUID]:
        """The runs an action applies to: a list of ids, or every run matching a filter."""
        if "filter" in body:
            if not isinstance(body["filter"], dict):
                raise Problem(400, "filter must be an object of list parameters")
            f = run_filter({k: str(v) for k, v in body["filter"].items() if v is not None}
                           )._replace(before=None)
            return [row["id"] for row in db.ui_runs(conn, f, BULK_LIMIT)]
        runs = body.get("runs")
        if not isinstance(runs, list) or not runs or len(runs) > BULK_LIMIT:
            raise Problem(400, f"runs must be a list of 1 to {BULK_LIMIT} run ids")
        return list(dict.fromkeys(_run_id(r) for r in runs))

    def _requeue(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        """Requeue each run whose claimer is dead (its lock is free); report the others."""
        done, refused = operations.requeue(conn, actor, self._target_runs(conn, body), all_or_nothing=False)
        return _answer(f"requeued {len(done)} run(s)", [each.run for each in done],
                       [refusal.why for refusal in refused], _all_unknown(refused))

    def _reschedule(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        done, refused = operations.reschedule(conn, actor, self._target_runs(conn, body), all_or_nothing=False)
        return _answer(f"scheduled {len(done)} new run(s) with the same args", [each.new for each in done],
                       [refusal.why for refusal in refused], _all_unknown(refused))

    def _cancel(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        """Cancel runs as `everystep cancel` does: at once if not running, at
        the next step boundary if running; a run that has ended is reported."""
        reason = body.get("reason") or None
        if reason is not None and not isinstance(reason, str):
            raise Problem(400, "reason must be a string")
        done, refused = operations.cancel(conn, actor, self._target_runs(conn, body), reason,
                                          all_or_nothing=False)
        asked = sum(each.status == "running" for each in done)
        message = f"cancelled {len(done) - asked} run(s)" + (
            f"; asked {asked} running run(s) to stop" if asked else "")
        return _answer(message, [each.run for each in done], [
            f"{refusal.run}: {refusal.why}" if refusal.status is None else f"{refusal.run}: already {refusal.status}"
            if refusal.status != "running" else f"{refusal.run}: asked to stop already"
            for refusal in refused], _all_unknown(refused))

    def _rerun(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        """Re-run ended runs from a step id: a new run each (operations.rerun_many)."""
        step = body.get("from_step")
        if not isinstance(step, str) or not step.strip():
            raise Problem(400, "from_step must be a step id, e.g. 3 or charge or fan.0.1")
        runs = self._target_runs(conn, body)
        done, refused = operations.rerun_many(conn, actor, runs, step.strip(), all_or_nothing=False)
        if len(runs) == 1 and refused:
            raise Problem(404 if refused[0].status is None else 409, refused[0].why)
        return _answer(f"re-ran {len(done)} run(s) from step {step.strip()}", [each.new for each in done],
                       [refusal.why for refusal in refused])

    def _bulk_request(self, body: dict) -> tuple[str, dict, dict]:
        """A bulk action by filter from the UI: the action, the filter (the
        list's filters: status, workflow, times, attributes; not the search
        box) and the action's arguments."""
        action = body.get("action")
        if action not in operations.BULK_ACTIONS:
            raise Problem(400, f"action must be one of {', '.join(operations.BULK_ACTIONS)}")
        query = body.get("filter")
        if not isinstance(query, dict):
            raise Problem(400, "filter must be an object of list parameters")
        query = {k: str(v) for k, v in query.items() if v not in (None, "")}
        if query.get("q"):
            raise Problem(400, "a bulk action takes the list's status, workflow, time and attribute filters, "
                               "not the search box: clear it")
        f = run_filter(query)
        given = {"workflow": f.workflow, "status": f.status, "since": f.since, "until": f.until,
                 "attributes": attribute_filter(query.get("attr"))}
        how: dict[str, Any] = {}
        if action == "cancel" and body.get("reason"):
            how["reason"] = str(body["reason"])
        if action == "rerun":
            how["from_step"] = str(body.get("from_step") or "").strip() or None
        if action == "resolve-step":
            how["step"] = str(body.get("step") or "").strip() or None
            outcome = body.get("outcome")
            if outcome == "result":
                how["result"] = _value(body.get("value"), "result")
            elif outcome == "error":
                how["error"] = str(body.get("value") or "") or None
            elif outcome == "discard":
                how["discard"] = True
        return action, {k: v for k, v in given.items() if v is not None}, how

    def _bulk_preview(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        """How many runs a bulk action by filter would act on, and the newest 20."""
        action, given, how = self._bulk_request(body)
        try:
            preview = operations.bulk(action, given, dry_run=True, actor=actor, conn=conn, **how)
        except EverystepError as exc:
            raise Problem(400, str(exc)) from None
        return {"message": f"{action} would act on {preview.count} run(s)", "count": preview.count,
                "sample": preview.sample, "filter": preview.filter}

    def _bulk(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        """A bulk action by filter, confirmed by the count the operator typed
        (`confirm`): refused when the filter finds another number of runs now."""
        action, given, how = self._bulk_request(body)
        try:
            preview = operations.bulk(action, given, dry_run=True, actor=actor, conn=conn, **how)
            if str(body.get("confirm", "")).strip() != str(preview.count):
                raise Problem(409, f"type the number of runs to confirm: the filter finds {preview.count} run(s) "
                                   "now")
            outcome = operations.bulk(action, given, dry_run=False, actor=actor, conn=conn, **how)
        except EverystepError as exc:
            raise Problem(400, str(exc)) from None
        return {"message": f"{action}: {outcome.done} of {outcome.count} run(s) done, {outcome.refused} refused",
                "count": outcome.count, "done_count": outcome.done, "refused_count": outcome.refused}

    def _send(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        run, topic = _run_id(body.get("run")), body.get("topic")
        if not isinstance(topic, str) or not topic.strip():
            raise Problem(400, "topic is empty: name the topic the run waits for (its step says which)")
        payload = _value(body.get("payload") or "null", "payload")
        try:
            operations.send_message(conn, actor, run, topic.strip(), payload)
        except operations.NotFound as unknown:
            raise Problem(404, str(unknown)) from None
        return {"message": f"sent a message on {topic.strip()!r} to run {run}", "done": [run]}

    def _schedule_action(self, conn: psycopg.Connection, actor: operations.Actor, body: dict) -> dict:
        key, verb = body.get("key"), body.get("verb")
        if not isinstance(key, str) or verb not in ("pause", "resume", "fire"):
            raise Problem(400, "key must be a schedule key and verb one of pause, resume, fire")
        if verb == "fire":
            run = operations.fire_schedule(conn, actor, key)
            return {"message": f"schedule {key} fired: run {run}", "done": [run]}
        (operations.pause_schedule if verb == "pause" else operations.resume_schedule)(conn, actor, key)
        return {"message": f"schedule {key} {verb}d"}


def _answer(message: str, done: list[uuid.UUID], refused: list[str],
            unknown: bool = False) -> dict:
    """The answer of an action on several runs: what it did, and what it
    refused. An action that did nothing is refused: 404 when no run named
    exists (`unknown`), else 409, with the first reason (it wrote nothing,
    not even an audit record)."""
    if refused and not done:
        more = f" (and {len(refused) - 1} more refused)" if len(refused) > 1 else ""
        raise Problem(404 if unknown else 409, f"nothing done: {refused[0]}{more}")
    return {"message": message + (f"; refused {len(refused)}" if refused else ""), "done": done, "refused": refused}


def _all_unknown(refused: list[operations.Refusal]) -> bool:
    return all(refusal.status is None for refusal in refused)


_ACTIONS = {
    "resolve": Console._resolve,
    "requeue": Console._requeue,
    "reschedule": Console._reschedule,
    "cancel": Console._cancel,
    "schedule": Console._schedule_action,
    "rerun": Console._rerun,
    "send": Console._send,
    "bulk-preview": Console._bulk_preview,
    "bulk": Console._bulk,
}
