"""A TERM sent to a child the instant it is forked, before it has put back
the default handlers of the signals it inherits from the supervisor:
python -m tests.apps.fork_race DATABASE_URL

The child's first steps are slowed down here, so that the TERM lands in that
window every time. Prints how the child ended."""

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    runtime_dir = tempfile.mkdtemp(prefix="everystep-fork-race-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(runtime_dir, "metrics")
    from supervisor import metrics_dir

    metrics_dir.prepare(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    from everystep.config import Config
    from supervisor import arbiter, children

    after_fork = children._after_fork

    def slow_after_fork(*args):
        time.sleep(1.0)  # the TERM arrives meanwhile
        after_fork(*args)

    children._after_fork = slow_after_fork
    supervisor = arbiter.Arbiter(Config(path=Path("everystep.yaml")), runtime_dir)
    supervisor.database_url = sys.argv[1]
    supervisor._install_signals()
    slot = supervisor._add("maintenance", "maintenance")
    supervisor._spawn(slot)
    os.kill(slot.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while (ended := os.waitpid(slot.pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended[0] == 0:
        os.kill(slot.pid, signal.SIGKILL)
        os.waitpid(slot.pid, 0)
        print("still running 10 s after the TERM")
    else:
        print(arbiter._describe(ended[1]))
    shutil.rmtree(runtime_dir)
