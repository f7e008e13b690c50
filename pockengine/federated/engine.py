"""A Flower simulation on one machine: the ServerApp in this process, the clients in at
most ``--parallel`` worker processes.

``ProcessGrid`` implements Flower's ``Grid`` (the ServerApp's only view of the
federation) over pipes to its worker processes. Each client is a virtual SuperNode: a
``Context`` (``partition-id`` in its node config, the run's config in its run config);
client ``i`` lives in worker ``i % P`` of the ``P`` workers (``FederatedConfig.processes``:
``--parallel``, default the machine's cores, at most one per client), which calls the
ClientApp on each of its clients' messages in turn, as a SuperNode does. Workers are
long-lived, so the compiled step survives from round to round, and the clients of one
worker share it (``LocalTrainer.serve``). The workers start when the server first asks
for its nodes: once it has checked that every client gets a batch, before its compile.
A ClientApp that raises is answered with an error reply (Flower's
``CLIENT_APP_RAISED_EXCEPTION``); a worker that dies, or that owes a reply when a round's
timeout ends, is replaced by a fresh process and the replies its clients owed are
missing, so the strategy drops those clients from the round and the run goes on.

Flower's own simulation engine needs Ray; this one needs only the standard library and
keeps the compiled steps in processes of their own, as real devices would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import queue
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from pockengine.federated.client import RUN_CONFIG_KEY
from pockengine.federated.config import FederatedConfig
from pockengine.federated.local import resolve_scheme
from pockengine.federated.server import SUMMARY, out_dir

__all__ = ["ProcessGrid", "simulate"]

log = logging.getLogger(__name__)
_FIRST_NODE = 1001


def simulate(config: FederatedConfig) -> dict[str, Any]:
    """Run the ServerApp against ``config.clients`` clients in at most
    ``config.processes()`` worker processes; the summary."""
    from pockengine.federated.server import app as server_app

    config = resolve_scheme(config.validate())  # --scheme auto: once, before any client
    logging.getLogger("flwr").propagate = False  # Flower prints through its own handler
    text = config.to_json()
    run_id = random.getrandbits(63)
    grid = ProcessGrid(text, config.clients, run_id, config.processes())
    TaskIdentity.task_id, TaskIdentity.run_id = 1, run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    context = Context(run_id, SUPERLINK_NODE_ID, {}, RecordDict(), {RUN_CONFIG_KEY: text})
    try:
        server_app(grid, context)
    finally:
        grid.close()
    summary: dict[str, Any] = json.loads((out_dir(config) / SUMMARY).read_text())
    return summary


def _worker(
    inbox: Connection,
    outbox: Connection,
    nodes: list[tuple[int, int]],
    clients: int,
    run: tuple[int, str],
    path: list[str],
) -> None:
    """Virtual SuperNodes (``nodes``: node id, partition): call the ClientApp on each
    message, in the order they came, until told to stop. A thread takes the messages off
    the pipe as they come, so the server never waits on a busy worker to send."""
    sys.path[:] = path  # a factory model's module must import here too
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pockengine.federated.client import app

    contexts = {
        node: Context(
            run[0],
            node,
            {"partition-id": client, "num-partitions": clients},
            RecordDict(),
            {RUN_CONFIG_KEY: run[1]},
        )
        for node, client in nodes
    }
    inbound: queue.Queue[Message | None] = queue.Queue()
    threading.Thread(target=_read, args=(inbox, inbound), daemon=True).start()
    while (message := inbound.get()) is not None:
        context = contexts[message.metadata.dst_node_id]
        try:
            reply = app(message, context)
        except Exception as exc:
            log.warning("client %s: %s", context.node_config["partition-id"], exc)
            error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}")
            reply = Message(error, reply_to=message)
        outbox.send(reply)


def _read(inbox: Connection, inbound: queue.Queue[Message | None]) -> None:
    """Move what arrives on ``inbox`` to ``inbound`` (None, the stop, also when the
    server's end closes)."""
    try:
        while (message := inbox.recv()) is not None:
            inbound.put(message)
    except (EOFError, OSError):
        pass
    inbound.put(None)


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self, process: Any, inbox: Connection, outbox: Connection) -> None:
        self.process, self.inbox, self.outbox = process, inbox, outbox


class ProcessGrid(Grid):
    """Flower's ``Grid`` over pipes to ``processes`` worker processes (default: one per
    client) hosting ``clients`` virtual SuperNodes."""

    def __init__(
        self, config_json: str, clients: int, run_id: int, processes: int | None = None
    ) -> None:
        self._run = Run.create_empty(run_id)
        self._config, self._clients = config_json, clients
        self._processes = max(1, min(clients, processes or clients))
        self._ctx = mp.get_context("spawn")  # torch's thread pools do not survive fork
        self._workers: dict[int, _Worker] = {}  # started on first use
        nodes = [_FIRST_NODE + i for i in range(clients)]
        self._waiting: dict[int, set[str]] = {n: set() for n in nodes}  # ids a node owes
        self._replies: list[Message] = []
        self._sent: dict[str, Message] = {}  # by id, until its reply is in

    def _worker_of(self, node_id: int) -> int:
        return (node_id - _FIRST_NODE) % self._processes

    def _nodes_of(self, worker: int) -> list[int]:
        return [n for n in self._waiting if self._worker_of(n) == worker]

    def _started(self) -> dict[int, _Worker]:
        """The workers, started on the first call."""
        if not self._workers:
            for worker in range(self._processes):
                self._start(worker)
        return self._workers

    def _start(self, worker: int) -> None:
        to_read, to_write = self._ctx.Pipe(duplex=False)  # server -> worker
        back_read, back_write = self._ctx.Pipe(duplex=False)  # worker -> server
        nodes = [(n, n - _FIRST_NODE) for n in self._nodes_of(worker)]
        args = (to_read, back_write, nodes, self._clients, (self._run.run_id, self._config),
                list(sys.path))  # fmt: skip
        process = self._ctx.Process(target=_worker, args=args, daemon=True)
        process.start()
        to_read.close()
        back_write.close()
        self._workers[worker] = _Worker(process, to_write, back_read)

    def _replace(self, worker: int, why: str) -> None:
        log.warning(
            "worker %d (nodes %s): %s; starting a fresh client process",
            worker,
            self._nodes_of(worker),
            why,
        )
        old = self._workers[worker]
        old.process.terminate()
        old.process.join(5)
        old.inbox.close()
        old.outbox.close()
        self._start(worker)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        self._started()
        return list(self._waiting)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        workers = self._started()
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as the SuperLink does
            node = message.metadata.dst_node_id
            workers[self._worker_of(node)].inbox.send(message)
            self._waiting[node].add(message.metadata.message_id)
            self._sent[message.metadata.message_id] = message
            ids.append(message.metadata.message_id)
        return ids

    def _collect(self, timeout: float | None) -> None:
        """Move the replies that arrive within ``timeout`` seconds into ``_replies``."""
        owing = {self._worker_of(n) for n, ids in self._waiting.items() if ids}
        pipes = {self._workers[w].outbox: w for w in owing}
        for ready in wait(list(pipes), timeout):
            worker = pipes[cast(Connection, ready)]
            try:
                reply: Message = cast(Connection, ready).recv()
            except EOFError:
                self._crashed(worker)
                continue
            message_id = reply.metadata.reply_to_message_id
            sent = self._sent.pop(message_id, None)
            if sent is not None:
                self._waiting[sent.metadata.dst_node_id].discard(message_id)
                self._replies.append(reply)

    def _crashed(self, worker: int) -> None:
        """A worker died: error replies for what its clients owed, and a fresh worker."""
        for node in self._nodes_of(worker):
            ids, self._waiting[node] = self._waiting[node], set()
            error = Error(ErrorCode.CLIENT_APP_CRASHED, "the client process died")
            self._replies += [Message(error, reply_to=self._sent.pop(i)) for i in ids]
        self._replace(worker, "its process died")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        self._collect(0)
        wanted = set(message_ids)
        out = [m for m in self._replies if m.metadata.reply_to_message_id in wanted]
        self._replies = [m for m in self._replies if m not in out]
        return out

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then collect replies until all are in or ``timeout`` seconds pass; the
        workers still owing a reply then are replaced (their replies would be stale)."""
        ids = set(self.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        got: list[Message] = []
        while ids:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._collect(left)
            for reply in self.pull_messages(ids):
                ids.discard(reply.metadata.reply_to_message_id)
                got.append(reply)
        late = {self._worker_of(node) for node, owed in self._waiting.items() if owed & ids}
        for worker in sorted(late):
            for node in self._nodes_of(worker):
                for message_id in self._waiting[node]:
                    self._sent.pop(message_id, None)
                self._waiting[node] = set()
            self._replace(worker, f"no reply within {timeout:.0f}s")
        return got

    def close(self) -> None:
        for worker in self._workers.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                worker.inbox.send(None)
        for worker in self._workers.values():
            worker.process.join(10)
            if worker.process.is_alive():
                worker.process.terminate()
            worker.inbox.close()
            worker.outbox.close()
