"""A Flower simulation on one machine: the ServerApp in this process, one OS process
per client.

``ProcessGrid`` implements Flower's ``Grid`` (the ServerApp's only view of the
federation) over pipes to N worker processes. Each worker holds one virtual SuperNode:
a ``Context`` (``partition-id`` in its node config, the run's config in its run config)
and the ClientApp, which it calls on every message it receives, as a SuperNode does.
A worker is a long-lived process, so a client's compiled step survives from round to
round. A ClientApp that raises is answered with an error reply (Flower's
``CLIENT_APP_RAISED_EXCEPTION``); a worker that dies, or that has not answered when a
round's timeout ends, is replaced by a fresh process and its reply is missing, so the
strategy drops that client from the round and the run goes on.

Flower's own simulation engine needs Ray; this one needs only the standard library and
keeps every client's compiled step in its own process, as a real device would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import random
import sys
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
    """Run the ServerApp against ``config.clients`` client processes; the summary."""
    from pockengine.federated.server import app as server_app

    config = resolve_scheme(config.validate())  # --scheme auto: once, before any client
    logging.getLogger("flwr").propagate = False  # Flower prints through its own handler
    text = config.to_json()
    run_id = random.getrandbits(63)
    grid = ProcessGrid(text, config.clients, run_id)
    TaskIdentity.task_id, TaskIdentity.run_id = 1, run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    context = Context(run_id, SUPERLINK_NODE_ID, {}, RecordDict(), {RUN_CONFIG_KEY: text})
    try:
        server_app(grid, context)
    finally:
        grid.close()
    summary: dict[str, Any] = json.loads((out_dir(config) / SUMMARY).read_text())
    return summary


def _worker(conn: Connection, node_id: int, client: int, clients: int, run: tuple[int, str],
            path: list[str]) -> None:  # fmt: skip
    """A virtual SuperNode: call the ClientApp on each message until told to stop."""
    sys.path[:] = path  # a factory model's module must import here too
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from pockengine.federated.client import app

    node_config: dict[str, bool | float | int | str] = {
        "partition-id": client, "num-partitions": clients,
    }  # fmt: skip
    context = Context(run[0], node_id, node_config, RecordDict(), {RUN_CONFIG_KEY: run[1]})
    while (message := conn.recv()) is not None:
        try:
            reply = app(message, context)
        except Exception as exc:
            log.warning("client %d: %s", client, exc)
            error = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(exc).__name__}: {exc}")
            reply = Message(error, reply_to=message)
        conn.send(reply)


class ProcessGrid(Grid):
    """Flower's ``Grid`` over pipes to one worker process per client."""

    def __init__(self, config_json: str, clients: int, run_id: int) -> None:
        self._run = Run.create_empty(run_id)
        self._config, self._clients = config_json, clients
        self._ctx = mp.get_context("spawn")  # torch's thread pools do not survive fork
        self._workers: dict[int, tuple[Any, Connection]] = {}
        self._waiting: dict[int, set[str]] = {}  # node -> ids of messages it owes a reply
        self._replies: list[Message] = []
        self._sent: dict[str, Message] = {}  # by id, until its reply is in
        for i in range(clients):
            self._start(_FIRST_NODE + i)

    def _start(self, node_id: int) -> None:
        parent, child = self._ctx.Pipe()
        args = (child, node_id, node_id - _FIRST_NODE, self._clients,
                (self._run.run_id, self._config), list(sys.path))  # fmt: skip
        process = self._ctx.Process(target=_worker, args=args, daemon=True)
        process.start()
        child.close()
        self._workers[node_id] = (process, parent)
        self._waiting[node_id] = set()

    def _replace(self, node_id: int, why: str) -> None:
        log.warning("node %d: %s; starting a fresh client process", node_id, why)
        process, conn = self._workers[node_id]
        process.terminate()
        process.join(5)
        conn.close()
        self._start(node_id)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
        ttl: float | None = None,
    ) -> Message:  # fmt: skip
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._workers)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as the SuperLink does
            node = message.metadata.dst_node_id
            self._workers[node][1].send(message)
            self._waiting[node].add(message.metadata.message_id)
            self._sent[message.metadata.message_id] = message
            ids.append(message.metadata.message_id)
        return ids

    def _collect(self, timeout: float | None) -> None:
        """Move the replies that arrive within ``timeout`` seconds into ``_replies``."""
        owing = {self._workers[n][1]: n for n, ids in self._waiting.items() if ids}
        for ready in wait(list(owing), timeout):
            conn = cast(Connection, ready)
            node = owing[conn]
            try:
                reply: Message = conn.recv()
            except EOFError:
                ids, self._waiting[node] = self._waiting[node], set()
                self._replace(node, "its process died")
                error = Error(ErrorCode.CLIENT_APP_CRASHED, "the client process died")
                self._replies += [Message(error, reply_to=self._sent.pop(i)) for i in ids]
                continue
            self._waiting[node].discard(reply.metadata.reply_to_message_id)
            self._sent.pop(reply.metadata.reply_to_message_id, None)
            self._replies.append(reply)

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
        clients still owing a reply then are replaced (their replies would be stale)."""
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
        for node, owed in self._waiting.items():
            if owed & ids:
                for message_id in owed:
                    self._sent.pop(message_id, None)
                self._waiting[node] = set()
                self._replace(node, f"no reply within {timeout:.0f}s")
        return got

    def close(self) -> None:
        for _process, conn in self._workers.values():
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for process, conn in self._workers.values():
            process.join(10)
            if process.is_alive():
                process.terminate()
            conn.close()
