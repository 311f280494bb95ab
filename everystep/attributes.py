"""Run attributes: what `schedule(..., attributes={...})` and
`everystep.set_attributes` accept, and finding runs by them
(`everystep.find_runs`, `everystep runs list --where K=V`, the bulk actions,
the UI's filter).

Attributes are a flat JSON object: string keys (at most MAX_KEYS of them,
each at most MAX_KEY_LENGTH characters) and scalar values (a string of at
most MAX_VALUE_LENGTH characters, a number, a boolean). A filter on them
matches values of the same type (`attributes @> {...}`, always through the
index): {"order": 42} finds 42, not "42". On the command line and in the
UI's URL a value is read as JSON when it is a number, true or false
(`order=42`), else as a string (`tenant=acme`; `code="42"` for the string).
"""

from __future__ import annotations

import datetime
import json
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from everystep import db
from everystep.connections import transaction_connection
from everystep.errors import EverystepError
from everystep.schema import MAX_ATTRIBUTES, RunStatus

MAX_KEYS = MAX_ATTRIBUTES
MAX_KEY_LENGTH = 64
MAX_VALUE_LENGTH = 256
STATUSES = (RunStatus.SCHEDULED, RunStatus.WAITING, RunStatus.RUNNING, RunStatus.COMPLETED, RunStatus.FAILED,
            RunStatus.STOPPED, RunStatus.BLOCKED, RunStatus.CANCELLED)


def check(what: str, attributes: Any) -> str | None:
    """Attributes as JSON text, checked (None or {}: None, no attributes);
    anything else than a flat object of scalars within the bounds is an
    EverystepError naming `what`, before anything is written."""
    if attributes is None:
        return None
    if not isinstance(attributes, Mapping):
        raise EverystepError(f"{what} takes a dict of attributes, e.g. {{'tenant': 'acme'}}, not {attributes!r:.80}")
    if len(attributes) > MAX_KEYS:
        raise EverystepError(f"{what}: {len(attributes)} attributes; a run has at most {MAX_KEYS}")
    for key, value in attributes.items():
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
            raise EverystepError(f"{what}: attribute key {key!r:.80} must be a non-empty string of at most "
                                 f"{MAX_KEY_LENGTH} characters")
        if isinstance(value, str):
            if len(value) > MAX_VALUE_LENGTH:
                raise EverystepError(f"{what}: attribute {key!r} has {len(value)} characters; a value has at "
                                     f"most {MAX_VALUE_LENGTH}")
        elif isinstance(value, bool) or (isinstance(value, int | float) and math.isfinite(value)):
            if len(json.dumps(value)) > MAX_VALUE_LENGTH:
                raise EverystepError(f"{what}: attribute {key!r} is a number of more than {MAX_VALUE_LENGTH} digits")
        else:
            raise EverystepError(f"{what}: attribute {key!r} is {value!r:.80}; a value is a string, a finite "
                                 "number or a boolean")
    return json.dumps(dict(attributes), ensure_ascii=False) if attributes else None


def check_many(what: str, attributes: Any, count: int) -> list[str | None] | None:
    """schedule_many's attributes: one dict for every run, or a list of one
    dict (or None) per run; as JSON texts, one per run (None: no run has any)."""
    if attributes is None:
        return None
    if isinstance(attributes, Mapping):
        one = check(what, attributes)
        return None if one is None else [one] * count
    if isinstance(attributes, str | bytes) or not isinstance(attributes, Iterable):
        raise EverystepError(f"{what} takes attributes= as one dict for every run or a list of one dict per run")
    given = list(attributes)
    if len(given) != count:
        raise EverystepError(f"{what}: attributes has {len(given)} dicts for {count} runs; give one per run "
                             "(or one dict for all)")
    return [check(f"{what} run {position}", each) for position, each in enumerate(given)]


def filter_value(text: str) -> Any:
    """A filter value written as text (the command line's --where, the UI's
    URL): a JSON number, true or false is that value; "..." (quoted) is the
    string inside; anything else is the string as written."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)
                                  and math.isfinite(value)) or isinstance(value, bool):
        return value
    return text


def parse_where(text: str) -> tuple[str, Any]:
    """`K=V` (the command line's --where, the UI's attr=K=V): the key, and
    the value as filter_value reads it."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise EverystepError(f"--where takes KEY=VALUE, e.g. tenant=acme, not {text!r:.80}")
    if len(key) > MAX_KEY_LENGTH or len(value) > MAX_VALUE_LENGTH:
        raise EverystepError(f"--where {text!r:.80}: a key has at most {MAX_KEY_LENGTH} characters, a value "
                             f"{MAX_VALUE_LENGTH}")
    return key, filter_value(value)


def statuses(what: str, status: Any) -> list[str] | None:
    """A status filter: one status or several (None: any)."""
    if status is None:
        return None
    given = [status] if isinstance(status, str) else list(status) if isinstance(status, Iterable) else [status]
    for each in given:
        if each not in STATUSES:
            raise EverystepError(f"{what}: unknown status {each!r}; one of {', '.join(STATUSES)}")
    return given or None


def _moment(what: str, value: Any) -> datetime.datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime.datetime) or value.tzinfo is None:
        raise EverystepError(f"{what} takes a datetime with a timezone, not {value!r:.80}")
    return value


def run_filter(what: str, *, workflow: Any = None, status: Any = None, attributes: Any = None, since: Any = None,
               until: Any = None) -> db.AttributeFilter:
    """A filter of runs, checked: EverystepError for anything malformed."""
    if workflow is not None and not isinstance(workflow, str):
        raise EverystepError(f"{what}: workflow is a module.qualname string, not {workflow!r:.80}")
    contains = None
    if attributes is not None:
        if not isinstance(attributes, Mapping) or not attributes:
            raise EverystepError(f"{what}: attributes is a non-empty dict, e.g. {{'tenant': 'acme'}}, "
                                 f"not {attributes!r:.80}")
        for key, value in attributes.items():
            if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
                raise EverystepError(f"{what}: attribute key {key!r:.80} must be a non-empty string of at most "
                                     f"{MAX_KEY_LENGTH} characters")
            if not isinstance(value, str | int | float | bool) or isinstance(value, float) and not math.isfinite(value):
                raise EverystepError(f"{what}: attribute {key!r} is {value!r:.80}; a value is a string, a finite "
                                     "number or a boolean")
        contains = json.dumps(dict(attributes), ensure_ascii=False)
    return db.AttributeFilter(workflow.replace(":", ".") if workflow else None, statuses(what, status), contains,
                              _moment(f"{what}: since", since), _moment(f"{what}: until", until))


class FoundRun(NamedTuple):
    """A run find_runs found."""

    id: uuid.UUID
    workflow: str  # module.qualname
    status: str
    attributes: dict  # {} when it has none
    idempotency_key: str | None
    created_at: datetime.datetime
    completed_at: datetime.datetime | None


def find_runs(*, workflow: str | None = None, status: str | Iterable[str] | None = None,
              attributes: Mapping[str, Any] | None = None, since: datetime.datetime | None = None,
              until: datetime.datetime | None = None, limit: int = 100, after: uuid.UUID | str | None = None,
              conn: Any = None) -> list[FoundRun]:
    """The runs of `workflow`, in `status` (one or several), whose attributes
    hold every `attributes` item (same value, same type), created in
    [since, until): one page of at most `limit`, newest first, hot runs and
    the history's alike. The next page: `after=` the last run's id.
    `conn`: a psycopg connection, else the bound one, else Django's."""
    f = run_filter("find_runs()", workflow=workflow, status=status, attributes=attributes, since=since, until=until)
    if type(limit) is not int or not 1 <= limit <= 10_000:
        raise EverystepError(f"find_runs(): limit is a whole number from 1 to 10000, not {limit!r:.40}")
    try:
        after = None if after is None else uuid.UUID(str(after))
    except ValueError:
        raise EverystepError(f"find_runs(): after is a run id, not {after!r:.80}") from None
    conn = transaction_connection(conn, "find_runs()", write=False)
    return [FoundRun(row["id"], row["name"], row["status"], row["attributes"] or {}, row["idempotency_key"],
                     row["created_at"], row["completed_at"])
            for row in db.find_runs(conn, f, limit, after)]
