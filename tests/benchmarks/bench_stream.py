"""stream: one run writing 10,000 entries of 40 bytes to a durable stream as
fast as it can, read by 50 concurrent readers — 25 with read_stream (in 5
processes), 25 over the UI's Server-Sent Events (an `everystep ui` server,
clients in 5 processes) — all connected before the run starts. Figures:
entries/s written (first write to last commit), and the commit-to-reader
latency of every entry at every reader, p50/p99 (the reader's moment when
the entry reached it; the commit's moment is the earlier of two stamps: the
writing process's once its statement returned, and an observer's, a process
that does nothing but LISTEN, when the commit's notification reached it.
The writer's stamp alone comes late whenever its thread waits for the CPU
or the GIL after the commit, up to several ms on a busy host, and made
latencies look shorter than they were; one host's clock). Targets: >=
5,000 entries/s written, p50 <= 5 ms, p99 <= 25 ms.

python -m tests.benchmarks.bench_stream [--entries N] [--readers N] [--sse-readers N] [--quick]
Prints one JSON line."""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time

import everystep
import everystep.db
from everystep.runner import Runner
from tests.benchmarks import harness, workflows

QUICK = {"entries": 500, "readers": 4, "sse_readers": 2}
PROCESSES = 5  # reader processes of each kind
VIEWER = "bench-viewer-token-0123456789abcdef"


def read_direct(url: str, run_id: str, threads: int, ready, results) -> None:
    """`threads` readers with read_stream, in this process: their receive times by offset."""
    import everystep  # noqa: PLC0415

    got: list[list[float]] = [[] for _ in range(threads)]

    def reader(i: int) -> None:
        entries = everystep.read_stream(run_id, "out", timeout=120, conn=url)  # connected and looked once
        ready.release()
        for _entry in entries:
            got[i].append(time.time())

    _run_threads(reader, threads)
    results.put(("read_stream", got))


def read_sse(base: str, run_id: str, clients: int, ready, results) -> None:
    """`clients` Server-Sent Events clients of the UI, each on its own
    socket, served by one thread of this process that waits on them all,
    as a browser's network thread does. The events are counted in the raw
    bytes as they arrive (a browser parses them in native code; an HTTP
    library's parser in Python, or a line splitter per event, would measure
    the client, not the server): every event of a read arrived with it.
    The server sends whole events in each chunk of its chunked response,
    so a chunk's size line ends just before an event's `id:`."""
    import selectors  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import urllib.parse  # noqa: PLC0415

    got: list[list[float]] = [[] for _ in range(clients)]
    tails = [b""] * clients  # the end of each socket's last read (an event's start may be cut between two)
    where = urllib.parse.urlsplit(base)
    request = (f"GET /api/runs/{run_id}/streams/out HTTP/1.1\r\nHost: {where.netloc}\r\n"
               f"Authorization: Bearer {VIEWER}\r\nAccept: text/event-stream\r\n\r\n").encode()
    with selectors.DefaultSelector() as selector:
        for i in range(clients):
            sock = socket.create_connection((where.hostname, where.port), timeout=120)
            sock.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:  # the response has started: the server follows the stream
                data = sock.recv(1 << 16)
                if not data:
                    raise ConnectionError(f"the UI's server closed the stream: {head[:200]!r}")
                head += data
            if not head.startswith(b"HTTP/1.1 200"):
                raise ConnectionError(f"the UI's server answered {head[:200]!r}")
            got[i].extend([time.time()] * head.count(b"\nid: "))
            tails[i] = head[-16:]
            selector.register(sock, selectors.EVENT_READ, i)
            ready.release()
        while selector.get_map():
            events = selector.select(timeout=120)
            if not events:
                raise TimeoutError("no event for 120 s")
            for key, _ in events:
                i, data = key.data, key.fileobj.recv(1 << 20)
                at, text = time.time(), tails[i] + data
                got[i].extend([at] * (text.count(b"\nid: ") - tails[i].count(b"\nid: ")))
                tails[i] = text[-16:]
                if not data or b"\nevent: end\n" in text:
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
    results.put(("sse", got))


def observe_commits(url: str, run_id: str, ready, results) -> None:
    """The moment each entry's commit was notified, to a process that has
    nothing else to do (one thread waiting on its LISTEN connection)."""
    import psycopg  # noqa: PLC0415

    from everystep import stream_readers  # noqa: PLC0415

    seen: dict[int, float] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        everystep.db.listen_streams(conn)
        ready.release()
        for notify in conn.notifies(timeout=300):
            at = time.time()
            notice = stream_readers.parse_notification(notify.payload)
            if notice.run != run_id:
                continue
            if notice.last is None:  # the run's end
                break
            first = notice.first if notice.first is not None else len(seen)  # no entries in it: those up to last
            for offset in range(first, notice.last + 1):
                seen.setdefault(offset, at)
    results.put(seen)


def _run_threads(target, count: int) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _spread(total: int) -> list[int]:
    """`total` readers over at most PROCESSES processes."""
    processes = min(PROCESSES, total)
    return [total // processes + (1 if i < total % processes else 0) for i in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--readers", type=int, default=25, help="readers with read_stream")
    parser.add_argument("--sse-readers", type=int, default=25, help="readers over the UI's Server-Sent Events")
    args = harness.arguments(parser, quick=QUICK)
    from tests.support.ui_process import UiProcess  # noqa: PLC0415

    spawn = multiprocessing.get_context("spawn")
    committed: dict[int, float] = {}
    original = everystep.db.write_streams

    def write_streams(conn, runner, writes):  # the commit's moment of every entry
        held = original(conn, runner, writes)
        now = time.time()
        for write in writes:
            for entry in write.entries:
                committed[entry.offset] = now
        return held

    with harness.schema() as db, harness.scratch() as folder:
        ui = UiProcess(db.url, folder / "ui", env={"EVERYSTEP_UI_VIEWER_TOKEN": VIEWER})
        try:
            base = ui.url
            with db.connect(autocommit=False) as conn:
                run_id = harness.schedule_in(conn, workflows.stream_writer, args.entries)
            ready, results = spawn.Semaphore(0), spawn.Queue()
            readers = [spawn.Process(target=read_direct, args=(db.url, str(run_id), n, ready, results))
                       for n in _spread(args.readers)]
            readers += [spawn.Process(target=read_sse, args=(base, str(run_id), args.sse_readers, ready, results))]
            observed = spawn.Queue()
            observer = spawn.Process(target=observe_commits, args=(db.url, str(run_id), ready, observed))
            for process in [*readers, observer]:
                process.start()
            for _ in range(args.readers + args.sse_readers + 1):
                ready.acquire(timeout=120)
            time.sleep(0.5)  # every reader waiting on its LISTEN
            everystep.db.write_streams = write_streams
            runner = Runner(db.pool, "bench-stream")
            try:
                with db.connect() as conn:
                    claimed = everystep.db.claim(conn, "bench-stream", 1)
                started = time.time()
                outcome = runner.execute(claimed[0]).outcome
            finally:
                runner.close()
                everystep.db.write_streams = original
            received = [(kind, times) for _ in readers for kind, got in [results.get(timeout=300)] for times in got]
            notified = observed.get(timeout=300)
            for process in [*readers, observer]:
                process.join(30)
        finally:
            ui.close()
    by_observer = sum(notified.get(offset, at) < at for offset, at in committed.items()) / len(committed)
    committed = {offset: min(at, notified.get(offset, at)) for offset, at in committed.items()}
    written_s = max(committed.values()) - started
    latencies_ms = {kind: [(at - committed[offset]) * 1000 for of_kind, times in received if of_kind == kind
                           for offset, at in enumerate(times)] for kind in ("read_stream", "sse")}
    cuts = harness.percentiles(latencies_ms["read_stream"] + latencies_ms["sse"])
    by_kind = {f"{kind}_p{p}_ms": round(harness.percentiles(of_kind)[f"p{p}"], 3)
               for kind, of_kind in latencies_ms.items() if of_kind for p in (50, 99)}
    harness.emit({
        "benchmark": "stream",
        "entries": args.entries,
        "readers": args.readers,
        "sse_readers": args.sse_readers,
        "entries_per_s": round(args.entries / written_s),
        "commit_to_reader_p50_ms": round(cuts["p50"], 3),
        "commit_to_reader_p99_ms": round(cuts["p99"], 3),
        **by_kind,
        "target_entries_per_s": 5000,
        "target_p50_ms": 5.0,
        "target_p99_ms": 25.0,
        "observer_stamp_earlier": round(by_observer, 3),  # the share of commits the observer saw first
        "entries_read": sum(map(len, latencies_ms.values())),
        "not_completed": int(outcome != "completed")
                         + sum(len(times) != args.entries for _, times in received)
                         + (len(received) != args.readers + args.sse_readers),
    })


if __name__ == "__main__":
    main()
