"""A Server-Sent Events client on httpx, as a browser's EventSource reads
(fields id/event/data, a blank line ends an event, `:` a comment)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import httpx


class Event(NamedTuple):
    id: str | None
    event: str
    data: str


def events(client: httpx.Client, url: str, headers: dict | None = None, timeout: float = 20.0) -> Iterator[Event]:
    """The events of one response, in order, until the server closes it."""
    with client.stream("GET", url, headers=headers or {}, timeout=timeout) as response:
        response.raise_for_status()
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if not line:
                if "data" in fields:
                    yield Event(fields.get("id"), fields.get("event", "message"), fields["data"])
                fields = {}
            elif not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
