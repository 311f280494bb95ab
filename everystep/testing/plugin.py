"""The pytest plugin's hook and fixtures (registered with pytest by the
package, through everystep.testing). Each fixture acts only when a test
asks for it: a test suite that uses none is not touched."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from everystep import faults, registry
from everystep.testing import server, workers


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "everystep(database_url=None, imports=()): the settings of the everystep_db fixture "
                   "(everystep.testing)")


@pytest.fixture
def everystep_settings(request: pytest.FixtureRequest) -> server.Settings:
    """The settings of everystep_db: from the test's `everystep` marker (the
    closest one), else the defaults. Override the fixture to set them for a
    whole folder or project."""
    marker = request.node.get_closest_marker("everystep")
    if marker is None:
        return server.Settings()
    if marker.args:
        raise pytest.UsageError("@pytest.mark.everystep takes keyword arguments only: database_url=, imports=")
    return server.Settings(**marker.kwargs)


@pytest.fixture
def everystep_db(everystep_settings: server.Settings) -> Iterator[psycopg.Connection]:
    """A connection (autocommit) to a schema of the test's own on the test
    server, migrated; dropped after the test, with every fault injected in it
    disarmed. drain(), the assertions and the worker fixture use this schema
    when given no connection."""
    for module in everystep_settings.imports:
        registry.import_module(module)
    server_url = server.server(everystep_settings.database_url)
    database = server.take(server_url)
    server.enter(database)
    try:
        with database.connect() as conn:
            yield conn
    finally:
        faults.disarm_all()
        server.give_back(database, server_url)


@pytest.fixture
def everystep_worker(everystep_db: psycopg.Connection) -> Iterator[workers.BackgroundWorker]:
    """A worker on threads of this process claiming the runs of the test's
    schema, started for the test (`.wait_idle()` waits until it has nothing
    left to do); drained and stopped after it."""
    worker = workers.BackgroundWorker(server.resolve(everystep_db)).start()
    try:
        yield worker
    finally:
        worker.stop()
