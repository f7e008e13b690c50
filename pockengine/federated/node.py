"""A long-lived ClientApp process for one Flower SuperNode: one compile per client.

In Flower 1.42 a SuperNode never runs a ClientApp itself. With ``--isolation
subprocess`` (the default) it starts ``flower-superexec``, which starts one
``flwr-clientapp`` process per task (per message): each round's process would build
the task and compile the step again. With ``--isolation process`` the SuperNode only
queues tasks on its Runtime API and leaves their execution to an outside process.

``serve`` is that outside process, for PockEngine's ClientApp only: it acquires the
node's ClientApp tasks one after another and runs each in this process, with Flower's
own task protocol (``flwr.supernode.runtime.run_clientapp``: pull the message and
context, push the reply and the task's output, heartbeats while it trains). The
ClientApp keeps its compiled step in this process (``client._TRAINERS``), so the
second and later rounds reuse it, as in the simulation.

It runs no code from the app bundle (FAB) the SuperLink sends: a task whose app does
not name ``pockengine.federated.client:app`` as its ClientApp is answered with an
error, and PockEngine's ClientApp is imported from the installed package.

    flower-supernode --insecure --superlink HOST:9092 --isolation process --port 9094 \\
        --node-config "partition-id=0 num-partitions=10"
    python -m pockengine.federated.node --runtime-api-address 127.0.0.1:9094 --insecure
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
from pathlib import Path

from flwr.app import Context, Error, Message
from flwr.common.config import get_fab_config
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

from pockengine.federated.client import app as pockengine_client_app

__all__ = ["CLIENT_APP", "main", "run_task", "serve"]

log = logging.getLogger(__name__)

CLIENT_APP = "pockengine.federated.client:app"


def serve(
    runtime_api_address: str,
    *,
    insecure: bool = True,
    root_certificates: Path | None = None,
    poll_s: float = 0.2,
    stop: threading.Event | None = None,
) -> None:
    """Run the SuperNode's ClientApp tasks in this process until ``stop`` is set."""
    stop = stop or threading.Event()
    certificates = root_certificates.read_bytes() if root_certificates else None
    acquirer = _client(runtime_api_address, insecure, certificates, "SuperExec", None)
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    log.info("serving the ClientApp tasks of the SuperNode at %s", runtime_api_address)
    try:
        while not stop.is_set():
            acquired = acquirer.AcquireTask(request)
            if acquired.HasField("task") and acquired.token:
                run_task(runtime_api_address, acquired.token, insecure, certificates)
            else:
                stop.wait(poll_s)
    finally:
        acquirer.close()


def run_task(address: str, token: str, insecure: bool, certificates: bytes | None) -> None:
    """One task, as ``flwr-clientapp`` runs it, but in this process (see module doc)."""
    client = _client(address, insecure, certificates, "flwr-clientapp", token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    context: Context | None = None
    status, details = SubStatus.FAILED, "the ClientApp task failed"
    try:
        message, context, _run, fab = pull_task_input(client)
        reply = _call(message, context, fab.content)
        if not reply.has_error():
            status, details = SubStatus.COMPLETED, ""
        else:
            details = reply.error.reason or "the ClientApp raised"
        push_message(client, reply, context)
    except Exception:
        log.exception("a ClientApp task could not be run")
    finally:
        push_task_output(client, context, status, details)
        heartbeat.stop()
        client.close()


def _call(message: Message, context: Context, fab: bytes) -> Message:
    """PockEngine's ClientApp on ``message``, or an error reply."""
    try:
        components = get_fab_config(fab)["tool"]["flwr"]["app"]["components"]
        named = str(components.get("clientapp"))
    except (KeyError, ValueError) as exc:
        named = f"an unreadable app bundle ({exc})"
    if named != CLIENT_APP:
        reason = f"this node runs only {CLIENT_APP}; the run's app names {named}"
        log.error("%s", reason)
        return Message(Error(ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason), reply_to=message)
    try:
        return pockengine_client_app(message=message, context=context)
    except Exception as exc:  # the server drops this client from the round, as Flower does
        log.warning("client %s: %s", context.node_config.get("partition-id"), exc)
        reason = f"{type(exc).__name__}: {exc}"
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)


def _client(
    address: str, insecure: bool, certificates: bytes | None, component: str, token: str | None
) -> RuntimeHttpClient:
    interceptors = [RuntimeVersionHttpInterceptor(component_name=component)]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))  # type: ignore[arg-type]
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pockengine.federated.node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--runtime-api-address",
        default="127.0.0.1:9094",
        help="the SuperNode's Runtime API (its --host:--port)",
    )
    p.add_argument("--insecure", action="store_true", help="plain HTTP to the SuperNode")
    p.add_argument("--root-certificates", type=Path, help="CA of the SuperNode's TLS certificate")
    p.add_argument("--parent-pid", type=int, help="stop when this process ends")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per Runtime API request
    if args.parent_pid is not None:
        start_parent_process_monitor(args.parent_pid)  # raises SIGINT here when it ends
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, or the parent ended
        serve(
            args.runtime_api_address,
            insecure=args.insecure,
            root_certificates=args.root_certificates,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
