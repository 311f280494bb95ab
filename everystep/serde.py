"""The extended JSON codec of the JSON columns, and exception encode/decode.

Plain JSON values are stored as themselves. The extended types are stored as
objects tagged with the key ``$es`` so they decode back to the same type:

    datetime  {"$es": "datetime", "v": "2026-01-02T03:04:05.000006+00:00"}
    date      {"$es": "date", "v": "2026-01-02"}
    time      {"$es": "time", "v": "03:04:05"}
    timedelta {"$es": "timedelta", "v": [days, seconds, microseconds]}
    UUID      {"$es": "uuid", "v": "0190..."}
    bytes     {"$es": "bytes", "v": "<base64>"}
    Decimal   {"$es": "decimal", "v": "12.50"}
    tuple     {"$es": "tuple", "v": [...]}
    Enum      {"$es": "enum", "cls": "module.Class", "v": <encoded value>}

A user dict that itself has a ``$es`` key is wrapped as ``{"$es": "dict",
"v": {...}}`` so it can never be mistaken for a tag. Tuples are tagged so a
step result reads back on replay exactly as it was first returned. Anything
else (sets, arbitrary objects, NaN, non-string dict keys) is refused with
`EverystepError` rather than silently changed.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import json
import math
import os
import traceback
import uuid
from typing import Any

from everystep.errors import EverystepError, StepFailure
from everystep.registry import import_path

TAG = "$es"
_SCALARS = (int, bool, type(None))
# One encoder for all: json.dumps with options builds a new one per call. Its
# input is plain data from `to_json`, which cannot contain itself.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=False)


def to_json(value: Any) -> Any:
    """Turn a value into plain JSON data, tagging the extended types."""
    cls = type(value)
    if cls is str:
        return _text(value)
    if cls in _SCALARS:
        return value
    if cls is float:
        if not math.isfinite(value):
            raise EverystepError(f"cannot store the float {value!r}: JSON has no NaN or infinity")
        return value
    if cls is list:
        return [to_json(item) for item in value]
    if cls is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise EverystepError(f"cannot store a dict with the non-string key {key!r}")
            out[_text(key)] = to_json(item)
        return {TAG: "dict", "v": out} if TAG in out else out
    if cls is tuple:
        return {TAG: "tuple", "v": [to_json(item) for item in value]}
    return _tag(value)


def _text(value: str) -> str:
    """A string PostgreSQL can store: jsonb has no NUL character, and UTF-8
    no lone surrogate (such as a bad `surrogateescape` decode leaves)."""
    if "\x00" in value:
        raise EverystepError(f"cannot store the string {value[:40]!r}...: it contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise EverystepError(f"cannot store the string {value[:40]!r}...: it is not valid Unicode") from None
    return value


def _tag(value: Any) -> Any:
    # Subclasses are handled here: enums (an IntEnum is an int), and
    # datetime before date because a datetime is a date.
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {TAG: "enum", "cls": f"{cls.__module__}.{cls.__qualname__}", "v": to_json(value.value)}
    if isinstance(value, dt.datetime):
        return {TAG: "datetime", "v": value.isoformat()}
    if isinstance(value, dt.date):
        return {TAG: "date", "v": value.isoformat()}
    if isinstance(value, dt.time):
        return {TAG: "time", "v": value.isoformat()}
    if isinstance(value, dt.timedelta):
        return {TAG: "timedelta", "v": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, uuid.UUID):
        return {TAG: "uuid", "v": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {TAG: "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, decimal.Decimal):
        return {TAG: "decimal", "v": str(value)}
    if isinstance(value, (str, int, float, list, dict, tuple)):
        # Subclasses of the plain types (a str subclass, a namedtuple, ...):
        # stored as their base type.
        for base in (bool, str, int, float, list, dict, tuple):
            if isinstance(value, base):
                return to_json(base(value))
    raise EverystepError(f"cannot store a value of type {type(value).__module__}.{type(value).__qualname__}")


def from_json(data: Any) -> Any:
    """Rebuild a value stored by `to_json`."""
    cls = type(data)
    if cls is list:
        return [from_json(item) for item in data]
    if cls is dict:
        tag = data.get(TAG)
        if tag is None:
            return {key: from_json(item) for key, item in data.items()}
        return _untag(tag, data)
    return data


def _untag(tag: str, data: dict) -> Any:
    v = data["v"]
    if tag == "dict":
        return {key: from_json(item) for key, item in v.items()}
    if tag == "tuple":
        return tuple(from_json(item) for item in v)
    if tag == "datetime":
        return dt.datetime.fromisoformat(v)
    if tag == "date":
        return dt.date.fromisoformat(v)
    if tag == "time":
        return dt.time.fromisoformat(v)
    if tag == "timedelta":
        return dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2])
    if tag == "uuid":
        return uuid.UUID(v)
    if tag == "bytes":
        return base64.b64decode(v)
    if tag == "decimal":
        return decimal.Decimal(v)
    if tag == "enum":
        return import_path(data["cls"])(from_json(v))
    raise EverystepError(f"unknown stored type tag {tag!r}")


def dumps(value: Any) -> str:
    """Encode a value as JSON text for a jsonb column."""
    return dump_data(encode(value))


def encode(value: Any) -> Any:
    """`to_json`, with a clear error for values nested too deeply (or cyclic)."""
    try:
        return to_json(value)
    except RecursionError:
        raise EverystepError("cannot store a value nested this deeply (or one that contains itself)") from None


def dump_data(data: Any) -> str:
    """JSON text of data already made plain by `to_json`."""
    return _ENCODER.encode(data)


def encode_exception(exc: BaseException) -> dict:
    """Exception -> {"type": "module.Class", "message": str, "args": [...]}."""
    cls = type(exc)
    if isinstance(exc, StepFailure) and exc.type:
        # A failure replayed from the store keeps the type it was recorded as.
        return {"type": exc.type, "message": _storable(str(exc)), "args": exc.original_args}
    args = []
    for arg in exc.args:
        try:
            args.append(to_json(arg))
        except EverystepError:
            args.append(_storable(repr(arg)))
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": _storable(str(exc)), "args": args}


TRACEBACK_LIMIT = 16 * 1024  # bytes of a step attempt's traceback kept: its end, where the error is


_ENGINE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def format_traceback(exc: BaseException) -> str:
    """The formatted traceback of `exc` (with its causes), as Python prints
    it, from the first frame of the application's (the engine's frames that
    called the step left out); its last TRACEBACK_LIMIT bytes when longer."""
    formatted = traceback.TracebackException.from_exception(exc)
    frames = list(formatted.stack)
    while len(frames) > 1 and frames[0].filename.startswith(_ENGINE):
        frames.pop(0)
    formatted.stack = traceback.StackSummary.from_list(frames)
    text = _storable("".join(formatted.format()))
    data = text.encode("utf-8")
    if len(data) <= TRACEBACK_LIMIT:
        return text
    tail = data[-TRACEBACK_LIMIT:].decode("utf-8", "ignore")
    return f"[the first {len(data) - len(tail.encode('utf-8'))} bytes left out]\n{tail}"


def _storable(text: str) -> str:
    """Text for an error message that can always be stored: what cannot be is
    escaped rather than refused (an error about a bad value must itself be
    recordable)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def decode_exception(data: dict) -> BaseException:
    """Rebuild the original exception when its class is importable, else
    `StepFailure` carrying the recorded type, message and args."""
    type_name = data.get("type", "")
    message = data.get("message", "")
    args = data.get("args", [])
    try:
        cls = import_path(type_name)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            exc = cls(*from_json(args))
            return exc
    except Exception:
        pass
    return StepFailure(message, type=type_name, args=args)
