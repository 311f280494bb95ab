"""A replicated PostgreSQL of the test's own: two PostgreSQL 15 nodes managed
by Patroni, with etcd as its configuration store, everything on loopback
ports found free at start (Debian's `patroni` and `etcd-server`).

PostgreSQL refuses to run as root: the nodes, Patroni and etcd run as the
`postgres` system user (created when missing), in a folder of their own under
the system's temporary directory (pytest's are private to their owner).
`close()` stops them all and removes the folder; a folder left by a test
process that died is cleaned up by the next cluster started."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from tests.support.processes import free_ports, wait_for

PATRONI = shutil.which("patroni") or "/usr/bin/patroni"
PATRONICTL = shutil.which("patronictl") or "/usr/bin/patronictl"
ETCD = shutil.which("etcd") or "/usr/bin/etcd"  # Debian's etcd-server ships /usr/bin/etcd
PG_BIN = Path("/usr/lib/postgresql/15/bin")
SYSTEM_USER = "postgres"
SCOPE = "everystep"
FOLDER_PREFIX = "everystep-patroni-"


def missing() -> str | None:
    """What this machine lacks to run a cluster, or None."""
    for path, package in ((PATRONI, "patroni"), (PATRONICTL, "patroni"), (ETCD, "etcd-server"),
                          (PG_BIN / "postgres", "postgresql-15")):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (apt-get install {package})"
    if os.geteuid() == 0:
        return None
    with contextlib.suppress(KeyError):
        if pwd.getpwnam(SYSTEM_USER).pw_uid == os.geteuid():
            return None
    return f"these tests run as root (they run the nodes as {SYSTEM_USER}) or as {SYSTEM_USER}"


def _system_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--home-dir", "/var/lib/postgresql", "--shell",
                        "/bin/bash", SYSTEM_USER], check=True, capture_output=True)
        return pwd.getpwnam(SYSTEM_USER)


def _processes_under(folder: Path) -> list[int]:
    """Pids of the processes started for `folder` (their command line names
    it: etcd, Patroni and every PostgreSQL process of its nodes)."""
    found = []
    needle = str(folder).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or needle in os.readlink(entry / "cwd").encode():
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _kill_all(folder: Path) -> None:
    for _ in range(50):
        pids = _processes_under(folder)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def clean_leftovers() -> None:
    """Remove the folders (and stop the processes) of clusters whose test
    process is gone."""
    for folder in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
        try:
            owner = int((folder / "owner").read_text())
        except (FileNotFoundError, ValueError):
            owner = None
        if owner is not None and Path(f"/proc/{owner}").exists():
            continue
        _kill_all(folder)
        shutil.rmtree(folder, ignore_errors=True)


class Node:
    def __init__(self, cluster: PatroniCluster, name: str, pg_port: int, api_port: int):
        self.cluster = cluster
        self.name = name
        self.pg_port = pg_port
        self.api_port = api_port
        self.folder = cluster.folder / name
        self.data = self.folder / "data"
        self.config_path = self.folder / "patroni.yml"
        self.log_path = self.folder / "patroni.log"
        self.process: subprocess.Popen | None = None

    def write_config(self, synchronous: bool) -> None:
        self.folder.mkdir()
        document = {
            "scope": SCOPE,
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{self.api_port}", "connect_address": f"127.0.0.1:{self.api_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.cluster.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    # Fast: a loop a second, a leader key of 10 s.
                    "ttl": 10, "loop_wait": 1, "retry_timeout": 3,
                    # A primary whose postmaster dies is failed over at once
                    # (by default Patroni restarts it in place for 300 s first).
                    "primary_start_timeout": 0,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_log_hints": "on",  # pg_rewind: an old primary rejoins as a standby
                            "track_commit_timestamp": "on",  # the tests read when each step was committed
                            "max_connections": 200,
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "fsync": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self.folder / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "replicator"},
                    "rewind": {"username": "postgres"},
                },
                "parameters": {"unix_socket_directories": str(self.folder)},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }
        self.config_path.write_text(yaml.safe_dump(document))
        self.cluster.give(self.folder)

    def start(self) -> None:
        self.log = open(self.log_path, "a")
        self.process = self.cluster.spawn([PATRONI, str(self.config_path)], self.log)

    def stop(self) -> None:
        """Stop Patroni (which stops its PostgreSQL)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        except (FileNotFoundError, IndexError, ValueError):
            return None

    def status(self) -> dict | None:
        """Patroni's REST API on this node: its role, state, timeline..."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/patroni", timeout=2) as answer:
                return json.load(answer)
        except OSError as exc:  # urllib's HTTPError (503 on a replica) carries the body too
            body = getattr(exc, "read", None)
            if body is not None:
                with contextlib.suppress(ValueError):
                    return json.loads(body())
            return None


class PatroniCluster:
    """Two nodes, node0 and node1; node0 bootstraps the cluster."""

    def __init__(self, synchronous: bool = True):
        clean_leftovers()
        self.user = _system_user() if os.geteuid() == 0 else pwd.getpwuid(os.geteuid())
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
        (self.folder / "owner").write_text(str(os.getpid()))
        self.folder.chmod(0o755)
        self.children: list[subprocess.Popen] = []
        etcd_port, peer_port, *node_ports = free_ports(6)
        self.etcd_port = etcd_port
        self.nodes = [Node(self, f"node{i}", node_ports[2 * i], node_ports[2 * i + 1]) for i in range(2)]
        try:
            self._start_etcd(peer_port)
            for node in self.nodes:
                node.write_config(synchronous)
            self.nodes[0].start()
            wait_for(lambda: self._role(self.nodes[0]) == "primary", timeout=90, interval=0.2,
                     what="node0 to bootstrap the cluster")
            self.nodes[1].start()
            self.wait_healthy(synchronous, timeout=120)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- processes

    def give(self, path: Path) -> None:
        """Hand `path` (and what is under it) to the system user."""
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                os.chown(os.path.join(root, name), self.user.pw_uid, self.user.pw_gid)
        os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def spawn(self, args: list[str], log) -> subprocess.Popen:
        env = {"PATH": f"{PG_BIN}:/usr/bin:/bin", "HOME": str(self.folder), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "PYTHONUNBUFFERED": "1"}
        as_user = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []} if os.geteuid() == 0 else {}
        process = subprocess.Popen(args, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True, **as_user)
        self.children.append(process)
        return process

    def _start_etcd(self, peer_port: int) -> None:
        data = self.folder / "etcd"
        data.mkdir()
        self.give(data)
        peer = f"http://127.0.0.1:{peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self.etcd_log = open(self.folder / "etcd.log", "w")
        self.etcd = self.spawn([
            ETCD, "--name", "etcd0", "--data-dir", str(data),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"etcd0={peer}", "--initial-cluster-state", "new",
            "--initial-cluster-token", self.folder.name,
        ], self.etcd_log)

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as answer:
                    return json.load(answer).get("health") == "true"
            except OSError:
                return False

        wait_for(answers, timeout=30, interval=0.1, what="etcd to answer")

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.stop()
        for process in self.children:
            if process.poll() is None:
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        _kill_all(self.folder)  # PostgreSQL processes left by a node whose Patroni was killed
        shutil.rmtree(self.folder, ignore_errors=True)

    # ---------------------------------------------------------------- state

    @staticmethod
    def _role(node: Node) -> str | None:
        status = node.status()
        if not status or status.get("state") != "running":
            return None
        return {"master": "primary"}.get(status.get("role"), status.get("role"))

    def cluster_state(self) -> dict:
        """Patroni's view of the cluster (GET /cluster), from any node that answers."""
        for node in self.nodes:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{node.api_port}/cluster", timeout=2) as answer:
                    return json.load(answer)
            except OSError:
                continue
        return {}

    def primary(self) -> Node | None:
        for member in self.cluster_state().get("members", []):
            if member.get("role") in ("leader", "master", "primary") and member.get("state") == "running":
                return next(node for node in self.nodes if node.name == member["name"])
        return None

    def standby(self) -> Node:
        primary = self.primary()
        return next(node for node in self.nodes if node is not primary)

    def _healthy(self, synchronous: bool) -> bool:
        members = self.cluster_state().get("members", [])
        primary = [m for m in members if m.get("role") in ("leader", "master", "primary") and m["state"] == "running"]
        standby_role = "sync_standby" if synchronous else "replica"
        standbys = [m for m in members if m.get("role") == standby_role and m.get("state") in ("running", "streaming")
                    and m.get("lag", 0) in (0, "0")]
        return len(primary) == 1 and len(standbys) == 1

    def wait_healthy(self, synchronous: bool, timeout: float = 90.0) -> None:
        """A primary and a standby streaming from it, synchronous or not as asked."""
        wait_for(lambda: self._healthy(synchronous), timeout=timeout, interval=0.2,
                 what=f"a primary and a {'synchronous' if synchronous else 'asynchronous'} standby: "
                      f"{self.cluster_state()}")

    # ---------------------------------------------------------------- actions

    def url(self, dbname: str = "postgres", **params: str) -> str:
        """A URL naming both nodes, for whichever of them is the primary."""
        hosts = ",".join(f"127.0.0.1:{node.pg_port}" for node in self.nodes)
        query = "&".join(f"{key}={value}" for key, value in {"target_session_attrs": "read-write", **params}.items())
        return f"postgresql://postgres@{hosts}/{dbname}?{query}"

    def node_url(self, node: Node, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{node.pg_port}/{dbname}"

    def patronictl(self, *args: str) -> str:
        result = subprocess.run([PATRONICTL, "-c", str(self.nodes[0].config_path), *args], capture_output=True,
                                text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
                                                             "LC_ALL": "C.UTF-8", "HOME": str(self.folder)})
        if result.returncode != 0:
            raise AssertionError(f"patronictl {' '.join(args)} failed: {result.stdout}{result.stderr}")
        return result.stdout

    def set_synchronous(self, synchronous: bool) -> None:
        """Switch synchronous_mode (a setting of the whole cluster, kept in etcd)."""
        self.patronictl("edit-config", "--force", "-s", f"synchronous_mode={'true' if synchronous else 'false'}")
        self.wait_healthy(synchronous)

    def kill_primary_postmaster(self) -> Node:
        """SIGKILL the primary's postmaster (its Patroni lives on, and fails the cluster over)."""
        primary = self.primary()
        assert primary is not None, self.cluster_state()
        pid = primary.postmaster_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        return primary

    def switchover(self) -> tuple[Node, Node]:
        """A planned switchover to the standby; returns (old, new primary)."""
        old, new = self.primary(), self.standby()
        self.patronictl("switchover", "--leader", old.name, "--candidate", new.name, "--force")
        return old, new

    def timeline_switch_lsn(self) -> int:
        """Where the latest timeline of the cluster starts (the WAL position
        of the last failover or switchover), from the primary's history."""
        primary = self.primary()
        with urllib.request.urlopen(f"http://127.0.0.1:{primary.api_port}/history", timeout=2) as answer:
            return json.load(answer)[-1][1]

    def wal_sender_pid(self, node: Node) -> int | None:
        """The pid of the WAL sender serving the standby, on `node` (a primary)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                status = (entry / "status").read_text()
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            if ppid == node.postmaster_pid() and "walsender" in cmdline:
                return int(entry.name)
        return None
