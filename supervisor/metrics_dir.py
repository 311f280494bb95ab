"""The supervisor's private metrics folder (prometheus_client multiprocess mode).

Every child writes its own files, named after its pid: `counter_<pid>.db`,
`histogram_<pid>.db`, `gauge_<mode>_<pid>.db`, ... and the HTTP child reads
them all on every scrape. So that hundreds of restarts do not make scrapes
slow, `mark_dead` folds a reaped child's files into one archive per kind
(`counter_archive.db`, `histogram_archive.db`, `gauge_max_archive.db`, ...),
keeping every count, and deletes what a dead process must stop reporting (its
gauges in the `live*` modes). Gauges in the `all` mode are left alone: their
series carry the pid, which an archive cannot keep (everystep has none).

Swapping files is done under the folder's exclusive lock, and readers hold the
shared lock while they read (`locked`), so a scrape never sees a dead child's
counts twice (archive and own file) or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger("everystep.supervisor")

LOCK_FILE = ".lock"
ARCHIVE = "archive"  # takes the place of the pid in an archive's file name
# A stuck peer must neither stall the arbiter nor hang a scrape: past this,
# go on without the lock (at worst one scrape double-counts or misses a child).
LOCK_WAIT_SECONDS = 1.0

Value = tuple[float, float]  # (value, timestamp) as stored in a .db file


def _add(old: Value, new: Value) -> Value:
    return old[0] + new[0], max(old[1], new[1])


def _highest(old: Value, new: Value) -> Value:
    return max(old, new, key=lambda v: v[0])


def _lowest(old: Value, new: Value) -> Value:
    return min(old, new, key=lambda v: v[0])


def _latest(old: Value, new: Value) -> Value:
    return max(old, new, key=lambda v: v[1])


# How two processes' values of one series combine, by file kind: the same
# arithmetic prometheus_client applies when it aggregates the files.
_COMBINE: dict[str, Callable[[Value, Value], Value]] = {
    "counter": _add,
    "histogram": _add,  # bucket counts (not cumulative in the files), sum
    "summary": _add,  # count, sum
    "gauge_sum": _add,
    "gauge_max": _highest,
    "gauge_min": _lowest,
    "gauge_mostrecent": _latest,
}


def prepare(path: str | os.PathLike) -> None:
    """Create the folder (private to the supervisor's user) and empty it of
    metrics files left by an earlier run. Only files this module or
    prometheus_client write are removed, so a mistyped path loses nothing else."""
    folder = Path(path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if entry.is_file() and (entry.suffix == ".db" or entry.name == LOCK_FILE or entry.name.endswith(".db.tmp")):
            entry.unlink()


@contextlib.contextmanager
def locked(path: str | os.PathLike, exclusive: bool) -> Iterator[bool]:
    """Hold the folder's lock, shared (readers) or exclusive (swapping files).
    Yields whether the lock was obtained within LOCK_WAIT_SECONDS."""
    fd = os.open(Path(path) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        held = _acquire(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not held:
            log.warning("metrics folder %s: lock not obtained in %gs, going on without it", path, LOCK_WAIT_SECONDS)
        yield held
    finally:
        os.close(fd)  # releases the lock


def _acquire(fd: int, mode: int) -> bool:
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


def mark_dead(path: str | os.PathLike, pid: int) -> None:
    """Account for a reaped child: fold its counters, histograms and non-live
    gauges into the archives, and delete its files (live gauges included)."""
    folder = Path(path)
    swaps = []  # (new archive written aside, archive, the dead child's file)
    for dead_file in sorted(folder.glob(f"*_{pid}.db")):
        kind = dead_file.name.removesuffix(f"_{pid}.db")
        combine = _COMBINE.get(kind)
        if combine is None:
            continue  # live gauges: deleted below; `all` gauges: kept (see above)
        archive = folder / f"{kind}_{ARCHIVE}.db"
        merged = _read(archive) if archive.exists() else {}
        for key, value in _read(dead_file).items():
            merged[key] = combine(merged[key], value) if key in merged else value
        aside = folder / f".{archive.name}.tmp"
        _write(aside, merged)
        swaps.append((aside, archive, dead_file))

    with locked(folder, exclusive=True):
        for aside, archive, dead_file in swaps:
            os.replace(aside, archive)
            dead_file.unlink()
        multiprocess.mark_process_dead(pid, str(folder))


def _read(db_file: Path) -> dict[str, Value]:
    if db_file.stat().st_size == 0:
        return {}  # the child died while creating it: nothing recorded
    return {key: (value, timestamp) for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(db_file)}


def _write(db_file: Path, values: dict[str, Value]) -> None:
    db_file.unlink(missing_ok=True)  # left by an interrupted merge
    out = MmapedDict(str(db_file))
    try:
        for key, (value, timestamp) in values.items():
            out.write_value(key, value, timestamp)
    finally:
        out.close()
