"""``pockengine federated --deployment``: the same apps under Flower's deployment engine.

``deploy`` starts, on 127.0.0.1 and free ports, a SuperLink (insecure, in-memory
state) and N SuperNodes with ``--node-config "partition-id=i num-partitions=N"``,
each SuperNode with ``--isolation process`` and one long-lived ClientApp process
(``node.serve``) beside it, so a client compiles its step once for the whole run.
It writes a Flower App project (``flower_project.write_app``: a ``pyproject.toml`` naming
``pockengine.federated.server:app`` and ``pockengine.federated.client:app``, the run's
``FederatedConfig`` as JSON under the run config key ``pockengine-config``) and a
Flower configuration naming the SuperLink (``flower_project.write_connection``) into a temporary
folder, and submits the app with ``flwr run --stream``. It logs a line per round as
``rounds.jsonl`` grows, and stops every process it started when the run ends, fails,
or is interrupted (Ctrl-C, SIGTERM): the process groups of those processes and of
their descendants are terminated, then killed. A ClientApp process that dies while its
SuperNode lives is started afresh (``LocalFederation.check``). ``--out`` receives what
the simulation writes, and each process's log in ``deployment-logs/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pockengine.federated.config import FederatedConfig, FederatedError
from pockengine.federated.flower_project import (
    CONNECTION,
    free_port,
    write_app,
    write_connection,
)
from pockengine.federated.local import check_shards, resolve_scheme
from pockengine.federated.processes import (
    live_members,
    process_table,
    signal_group,
    terminate_raises,
)
from pockengine.federated.server import ROUNDS, SUMMARY, out_dir
from pockengine.out_folder import install_folder

__all__ = [
    "LocalFederation", "deploy", "free_port", "live_members", "write_app", "write_connection",
]  # fmt: skip

log = logging.getLogger(__name__)

LOGS = "deployment-logs"  # in --out: each process's log
_STARTUP_S = 180.0  # imports of torch and Flower on a loaded machine
_STOP_S = 10.0
_RESTARTS = 3  # fresh ClientApp processes a node gets while its SuperNode lives


def deploy(config: FederatedConfig) -> dict[str, Any]:
    """Run ``config`` under a local deployment engine (module docstring); the summary."""
    config = resolve_scheme(_absolute_out(config.validate()))  # once, before any client
    if config.clients > config.processes():
        raise FederatedError(
            f"--deployment starts a SuperNode and a ClientApp process for each client: "
            f"{config.clients} clients exceed --parallel {config.processes()}; use --clients "
            f"{config.processes()} or fewer, or a larger --parallel"
        )
    check_shards(config)  # every client gets a batch, before any process starts
    out = out_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    before = _mtime(out / SUMMARY)
    with terminate_raises(), tempfile.TemporaryDirectory(prefix="pockengine-flower-") as tmp:
        try:
            with LocalFederation(config.clients, Path(tmp), config.threads) as federation:
                federation.start()
                run = federation.submit(write_app(Path(tmp) / "app", config))
                _follow(run, federation, out / ROUNDS, config.rounds)
        finally:
            _keep_logs(Path(tmp), out / LOGS)
    if _mtime(out / SUMMARY) == before:
        raise FederatedError(
            f"the deployed run ended without a summary in {out}; the end of its log "
            f"({out / LOGS / 'flwr-run.log'}):\n" + _tail(out / LOGS / "flwr-run.log")
        )
    summary: dict[str, Any] = json.loads((out / SUMMARY).read_text())
    return summary


def _keep_logs(folder: Path, logs: Path) -> None:
    """Each process's log, into ``logs`` (replacing an earlier run's, once copied)."""
    kept = Path(tempfile.mkdtemp(prefix=f".{logs.name}.", suffix=".tmp", dir=logs.parent))
    try:
        for path in folder.glob("*.log"):
            shutil.copyfile(path, kept / path.name)
        install_folder(kept, logs)
    except BaseException:
        shutil.rmtree(kept, ignore_errors=True)
        raise


def _tail(path: Path, lines: int = 20) -> str:
    """The last lines of a log (for errors)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class LocalFederation:
    """A SuperLink and N SuperNodes, each with its ClientApp process, on 127.0.0.1.

    Every process starts in a process group of its own. ``close`` ends those groups and
    the groups of all their descendants (``flower-superexec`` starts a session of its
    own; ``flwr-serverapp`` runs in it): SIGTERM, then SIGKILL for what is left.
    """

    def __init__(self, clients: int, folder: Path, threads: int = 1) -> None:
        self.clients, self.folder = clients, folder
        self.stop_s = _STOP_S  # how long ``close`` waits for SIGTERM before SIGKILL
        self.home = folder / "flower-home"
        self.port = free_port()
        self.processes: list[_Process] = []
        self.lost: set[str] = set()  # nodes (partition ids) whose processes died mid-run
        self.node_ports: dict[int, int] = {}  # partition id -> its SuperNode's Runtime API
        self.restarts: dict[int, int] = {}  # partition id -> ClientApp processes restarted
        self.retired: list[_Process] = []  # dead ClientApp processes (their groups end too)
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.home),  # runs, apps and the connection stay in the folder
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),  # a factory's module
            "OMP_NUM_THREADS": str(threads),
        }

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """The SuperLink, the SuperNodes (they retry until the SuperLink answers) and,
        as each SuperNode listens, its ClientApp process; returns when all are started
        (the ServerApp waits for the N nodes)."""
        write_connection(self.home, self.address)
        self._spawn(
            "superlink",
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        )
        node_ports = [free_port() for _ in range(self.clients)]
        for i, port in enumerate(node_ports):
            self._spawn(
                f"supernode-{i}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                self.address,
                "--isolation",
                "process",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--node-config",
                f"partition-id={i} num-partitions={self.clients}",
            )
        self._wait_listening(self.port, "superlink")
        for i, port in enumerate(node_ports):
            self._wait_listening(port, f"supernode-{i}")
            self.node_ports[i] = port
            self._start_clientapp(i)

    def _start_clientapp(self, node: int) -> _Process:
        return self._spawn(
            f"clientapp-{node}",
            sys.executable,
            "-m",
            "pockengine.federated.node",
            "--insecure",
            "--runtime-api-address",
            f"127.0.0.1:{self.node_ports[node]}",
            "--parent-pid",
            str(os.getpid()),
        )

    def submit(self, app: Path) -> _Process:
        """``flwr run APP --stream`` against this SuperLink; it ends with the run."""
        return self._spawn("flwr-run", "flwr", "run", str(app), CONNECTION, "--stream")

    def check(self, tolerate_nodes: bool = False) -> None:
        """A ``FederatedError`` if the SuperLink, a SuperNode or a ClientApp process
        died. With ``tolerate_nodes`` (once the rounds run) a node whose SuperNode or
        ClientApp process died is logged once and left out (the server drops it from
        its rounds); only the SuperLink's end, or the loss of every node, is an error.
        A ClientApp process that died while its SuperNode lives is started afresh (it
        compiles again on its next task), up to ``_RESTARTS`` times a node."""
        for p in list(self.processes):
            if p.name == "flwr-run" or p.popen.poll() is None or self._restarted(p):
                continue
            died = f"{p.name} exited with code {p.popen.returncode}"
            if not tolerate_nodes or p.name == "superlink":
                raise FederatedError(f"{died}; the end of its log:\n{_tail(p.log)}")
            node = p.name.rpartition("-")[2]
            if node not in self.lost:
                self.lost.add(node)
                log.warning(
                    "node %s is lost (%s; its log: %s/%s.log); the run goes on without it",
                    node,
                    died,
                    LOGS,
                    p.name,
                )
        if len(self.lost) == self.clients:
            raise FederatedError(f"every node has stopped; their logs are in --out's {LOGS}/")

    def _restarted(self, p: _Process) -> bool:
        """Whether dead ``p`` was a ClientApp process, now replaced (its log kept as
        ``clientapp-I.K.log``); False if its SuperNode died too or it restarted enough."""
        kind, _, node = p.name.rpartition("-")
        supernode = next((q for q in self.processes if q.name == f"supernode-{node}"), None)
        alive = supernode is not None and supernode.popen.poll() is None
        done = self.restarts.get(int(node), 0) if node.isdigit() else _RESTARTS
        if kind != "clientapp" or not alive or done >= _RESTARTS:
            return False
        self.restarts[int(node)] = done + 1
        p.log.rename(p.log.with_name(f"{p.name}.{done}.log"))
        self.processes.remove(p)
        self.retired.append(p)
        log.warning(
            "%s exited with code %s; started a fresh one (its log: %s/%s.%d.log)",
            p.name,
            p.popen.returncode,
            LOGS,
            p.name,
            done,
        )
        self._start_clientapp(int(node))
        return True

    def close(self) -> None:
        """End every process this federation started (module docstring)."""
        groups = self.process_groups
        for group in groups:
            signal_group(group, signal.SIGTERM)
        end = time.monotonic() + self.stop_s
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(max(0.1, end - time.monotonic()))
        groups = sorted({*groups, *self.process_groups})
        for group in groups:  # what TERM left, helpers included
            signal_group(group, signal.SIGKILL)
        for p in [*self.processes, *self.retired]:
            p.popen.wait()
        end = time.monotonic() + self.stop_s
        while live_members(groups) and time.monotonic() < end:
            time.sleep(0.05)  # a killed process is gone once it is scheduled again

    @property
    def process_groups(self) -> list[int]:
        """The process groups of the processes started and of their live descendants
        (``flower-superexec`` starts a session of its own)."""
        leaders = [p.popen.pid for p in [*self.processes, *self.retired]]
        table = process_table()
        family, grew = set(leaders), True
        while grew:
            more = {pid for pid, (ppid, _, _) in table.items() if ppid in family} - family
            family, grew = family | more, bool(more)
        return sorted({*leaders, *(table[pid][1] for pid in family if pid in table)})

    def _spawn(self, name: str, program: str, *args: str) -> _Process:
        log_path = self.folder / f"{name}.log"
        with log_path.open("wb") as sink:
            popen = subprocess.Popen(
                [_tool(program), *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        process = _Process(name, popen, log_path)
        self.processes.append(process)
        return process

    def _wait_listening(self, port: int, name: str) -> None:
        end = time.monotonic() + _STARTUP_S
        while time.monotonic() < end:
            self.check()
            with socket.socket() as s, contextlib.suppress(OSError):
                s.settimeout(1.0)
                s.connect(("127.0.0.1", port))
                return
            time.sleep(0.2)
        raise FederatedError(f"{name} did not listen on port {port} in {_STARTUP_S:.0f}s")


def _follow(run: _Process, federation: LocalFederation, rounds: Path, total: int) -> None:
    """Log each round as the server appends it, until ``flwr run`` ends."""
    old = set(_whole_lines(rounds))  # a resumed run's earlier rounds
    logged: set[str] = set()
    while True:
        done = run.popen.poll() is not None
        for line in _whole_lines(rounds):
            if line in old or line in logged:
                continue
            logged.add(line)
            row = json.loads(line)
            log.info(
                "round %d/%d: accuracy %.4f, loss %.4f, up %d B (full model %d B), clients %s",
                row["round"],
                total,
                row["accuracy"],
                row["loss"],
                row["bytes_up"],
                row["bytes_full_model"],
                row["clients"],
            )
        if done:
            return
        federation.check(tolerate_nodes=bool(logged))  # a node lost mid-run is dropped
        time.sleep(0.5)


def _whole_lines(path: Path) -> list[str]:
    """The complete lines of a file being appended to ([] if it does not exist)."""
    text = path.read_text() if path.exists() else ""
    return text[: text.rfind("\n") + 1].splitlines()


def _tool(program: str) -> str:
    """A Flower command (or this Python) by path: beside this interpreter, or on PATH."""
    if os.path.isabs(program):
        return program
    beside = Path(sys.executable).parent / program
    if beside.exists():
        return str(beside)
    found = shutil.which(program)
    if found is None:
        raise FederatedError(
            f"--deployment needs Flower's command {program!r}: pip install 'pockengine[federated]'"
        )
    return found


def _absolute_out(config: FederatedConfig) -> FederatedConfig:
    """The config with ``out`` as an absolute path (the ServerApp runs elsewhere)."""
    ft = dataclasses.replace(config.finetune, out=str(out_dir(config).resolve()))
    return dataclasses.replace(config, finetune=ft)


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None
