"""``pockengine federated --deployment`` (issue 18): the apps under Flower's deployment
engine, a local SuperLink and N SuperNodes, each with a long-lived ClientApp process.

The default run checks the parts: the app project and connection files Flower reads,
the ClientApp process's refusal of another app, and that stopping the federation ends
every process it started. The end-to-end runs (real SuperLink, SuperNodes, ``flwr
run``) take over a minute on a loaded 2-core machine, so they are marked slow: a
deployed run equals the simulation with the same seed, compiles each client once, and
leaves no process behind, also when interrupted with Ctrl-C; a node killed mid-run is
dropped and the run goes on; a server stopped after a round resumes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

from pockengine.federated import FederatedConfig, FederatedError
from pockengine.finetune import FinetuneConfig
from tests.test_federated import finetune, rounds_log  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(
    find_spec("flwr") is None, reason="Flower is not installed: pip install 'pockengine[federated]'"
)


def with_marker(marker: str) -> list[int]:
    """Live processes whose environment mentions ``marker`` (every process a deployment
    starts has its ``FLWR_HOME`` under the temporary folder)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                state = (environ.parent / "stat").read_text().rpartition(")")[2].split()[0]
                if state != "Z":
                    found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


# -- the parts (no SuperLink) ---------------------------------------------------------


# Flower's FAB builder calls pathspec's deprecated "gitwildmatch" (not ours to change)
_FAB_BUILD = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")


@_FAB_BUILD
def test_the_app_project_is_a_flower_app_carrying_the_config(tmp_path: Path) -> None:
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.config import get_fab_config, get_project_config, validate_config

    from pockengine.federated.client import RUN_CONFIG_KEY
    from pockengine.federated.deployment import write_app

    ft = FinetuneConfig(recipe="minilm-bbc", out=str(tmp_path / "out"), seq_len=64)
    config = FederatedConfig(finetune=ft, clients=3, rounds=2, fail=("1:2",))
    app = write_app(tmp_path / "app", config)
    project = get_project_config(app)
    valid, errors, _warnings = validate_config(project, check_module=True)
    assert valid, errors
    components = project["tool"]["flwr"]["app"]["components"]
    assert components == {
        "serverapp": "pockengine.federated.server:app",
        "clientapp": "pockengine.federated.client:app",
    }
    carried = project["tool"]["flwr"]["app"]["config"][RUN_CONFIG_KEY]
    assert FederatedConfig.from_json(carried) == config
    # what the SuperLink ships to the nodes: the ClientApp process reads it from there
    fab = get_fab_config(build_fab_from_disk(app))
    assert fab["tool"]["flwr"]["app"]["components"] == components


def test_flower_reads_the_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.cli.flower_config import read_superlink_connection

    from pockengine.federated.deployment import CONNECTION, write_connection

    write_connection(tmp_path / "home", "127.0.0.1:19093")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    connection = read_superlink_connection(None)
    assert connection.name == CONNECTION
    assert connection.address == "127.0.0.1:19093" and connection.insecure


@_FAB_BUILD
def test_the_clientapp_process_runs_no_other_app(tmp_path: Path) -> None:
    """A task whose app names another ClientApp gets an error reply; nothing of the
    app bundle is imported."""
    from flwr.app import Context, Message, MessageType, RecordDict
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import ErrorCode
    from flwr.supercore.task_identity import TaskIdentity

    from pockengine.federated import node
    from pockengine.federated.deployment import write_app

    app = write_app(tmp_path / "app", FederatedConfig())
    (app / "evil.py").write_text("raise SystemExit('imported')\n")
    text = (app / "pyproject.toml").read_text()
    (app / "pyproject.toml").write_text(text.replace(node.CLIENT_APP, "evil:app"))
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 1
    message = Message(RecordDict(), 1, MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = "m1"
    context = Context(7, 1, {"partition-id": 0}, RecordDict(), {})
    reply = node._call(message, context, build_fab_from_disk(app))
    assert reply.has_error() and reply.error.code == ErrorCode.LOAD_CLIENT_APP_EXCEPTION
    assert "evil:app" in str(reply.error.reason) and "evil" not in sys.modules


_LEADER = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
# a helper in a session of its own, as flower-superexec is, for the stubborn one
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=sys.argv[1] == "stubborn")
print("helper", child.pid, flush=True)
time.sleep(120)
"""


def test_close_ends_every_process_group(tmp_path: Path) -> None:
    """Leaders and the helpers they start (as the SuperLink starts flower-superexec)
    all end, also a leader that ignores SIGTERM; a dead process is reported with its log."""
    from pockengine.federated.deployment import LocalFederation, live_members

    federation = LocalFederation(2, tmp_path)
    federation.stop_s = 1.0
    with federation:
        for kind in ("polite", "stubborn"):
            federation._spawn(kind, sys.executable, "-c", _LEADER, kind)
        crash = federation._spawn("crash", sys.executable, "-c", "print('boom'); exit(3)")
        crash.popen.wait(30)
        with pytest.raises(FederatedError, match=r"(?s)crash exited with code 3.*boom"):
            federation.check()
        end = time.monotonic() + 30
        while len(live_members(federation.process_groups)) < 4 and time.monotonic() < end:
            time.sleep(0.05)  # both leaders and their helpers
        assert len(live_members(federation.process_groups)) == 4
    assert live_members(federation.process_groups) == []
    for kind in ("polite", "stubborn"):
        helper = int((tmp_path / f"{kind}.log").read_text().split()[1])
        assert not Path(f"/proc/{helper}").exists() or _zombie(helper)


def test_a_dead_clientapp_process_is_restarted_while_its_supernode_lives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ClientApp process that exits beside a live SuperNode is replaced (up to the
    limit, its old log kept); beside a dead SuperNode the node is lost instead."""
    from pockengine.federated import deployment

    federation = deployment.LocalFederation(2, tmp_path)
    federation.stop_s = 1.0
    sleep, crash = ("sleep", "60"), ("sh", "-c", "echo crashed; exit 3")
    started: list[int] = []

    def start_clientapp(node: int) -> object:
        started.append(node)
        return federation._spawn(f"clientapp-{node}", *crash)

    monkeypatch.setattr(federation, "_start_clientapp", start_clientapp)
    with federation:
        for node in (0, 1):
            federation._spawn(f"supernode-{node}", *(sleep if node == 0 else crash))
            start_clientapp(node)
        for attempt in range(deployment._RESTARTS + 1):
            for p in federation.processes:
                if p.name != "supernode-0":
                    p.popen.wait(30)
            if attempt < deployment._RESTARTS:
                federation.check(tolerate_nodes=True)
                assert federation.lost == {"1"}  # its SuperNode is dead: no restart
        with pytest.raises(FederatedError, match="every node has stopped"):
            federation.check(tolerate_nodes=True)  # node 0 restarted enough: lost too
        assert started == [0, 1] + [0] * deployment._RESTARTS
        assert federation.restarts == {0: deployment._RESTARTS}
        assert "crashed" in (tmp_path / "clientapp-0.0.log").read_text()
        assert len(federation.retired) == deployment._RESTARTS
    assert deployment.live_members(federation.process_groups) == []


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


# -- real deployments (slow) ------------------------------------------------------------


def _args(ft: FinetuneConfig, out: str, rounds: int = 2) -> list[str]:
    return [
        "federated", "--deployment", "--model", str(ft.model), "--data", str(ft.data),
        "--text-column", "review", "--label-column", "sentiment", "--seq-len", "12",
        "--batch-size", "8", "--lr", "0.01", "--scheme", str(ft.scheme),
        "--clients", "2", "--rounds", str(rounds), "--out", out,
    ]  # fmt: skip


@pytest.mark.slow
def test_a_deployed_run_is_the_simulation_and_leaves_no_process(
    finetune: FinetuneConfig,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """2 SuperNodes, 2 rounds: the same rounds and, bit for bit, the same global state
    as the simulation (FedAvg of two clients does not depend on the replies' order);
    each client compiled once; no process left."""
    import dataclasses

    from safetensors.numpy import load_file

    from pockengine.cli import main
    from pockengine.federated.engine import simulate

    marker = tmp_path / "flower-tmp"
    marker.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(marker))
    assert main(_args(finetune, str(finetune.out))) == 0
    assert "2 round(s) of 2 client(s)" in capsys.readouterr().out
    assert with_marker(str(marker)) == []
    simulated = dataclasses.replace(finetune, out=f"{finetune.out}-simulated")
    simulate(FederatedConfig(finetune=simulated, clients=2, rounds=2))
    deployed_rows, simulated_rows = rounds_log(finetune), rounds_log(simulated)
    assert [r["round"] for r in deployed_rows] == [1, 2]
    for got, want in zip(deployed_rows, simulated_rows, strict=True):
        assert set(got) == set(want)
        for key in ("accuracy", "loss", "bytes_up", "bytes_down", "bytes_full_model",
                    "clients", "dropped", "train_loss"):  # fmt: skip
            assert got[key] == want[key], key
    deployed = load_file(str(Path(str(finetune.out)) / "global.safetensors"))
    expected = load_file(str(Path(str(simulated.out)) / "global.safetensors"))
    for name, array in expected.items():
        np.testing.assert_array_equal(deployed[name], array, err_msg=name)
    for i in (0, 1):
        log = (Path(str(finetune.out)) / "deployment-logs" / f"clientapp-{i}.log").read_text()
        assert log.count(f"client {i}: compiled in") == 1  # round 2 reused the step


@pytest.mark.slow
def test_ctrl_c_stops_every_process(finetune: FinetuneConfig, tmp_path: Path) -> None:  # noqa: F811
    """SIGINT to the command once its run is submitted: it exits, and every process it
    started (SuperLink, SuperNodes, their helpers, ClientApps, flwr run) is gone."""
    marker = tmp_path / "flower-tmp"
    marker.mkdir()
    env = {**os.environ, "TMPDIR": str(marker), "PYTHONPATH": os.pathsep.join(sys.path)}
    args = _args(finetune, str(finetune.out))
    command = subprocess.Popen([sys.executable, "-m", "pockengine", *args], env=env)
    try:
        end = time.monotonic() + 240
        # the run is submitted (flwr run started) and all 2N + 2 processes are up
        while time.monotonic() < end and not (
            list(marker.glob("pockengine-flower-*/flwr-run.log"))
            and len(with_marker(str(marker))) >= 7
        ):
            time.sleep(0.5)
        assert time.monotonic() < end, "the federation did not start"
        time.sleep(3)  # into the run
        command.send_signal(signal.SIGINT)
        assert command.wait(60) != 0
    finally:
        command.kill()
    end = time.monotonic() + 10
    while with_marker(str(marker)) and time.monotonic() < end:
        time.sleep(0.2)
    assert with_marker(str(marker)) == []


def _kill_node(pids: list[int], partition: int, supernode: bool = True) -> None:
    """SIGKILL the SuperNode of ``partition`` (unless not ``supernode``) and the ClientApp
    process beside it (found by the SuperNode's Runtime API port in their command lines)."""
    lines = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            lines[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    node = next(pid for pid, argv in lines.items() if f"partition-id={partition}".encode()
                in b" ".join(argv) and b"flower-supernode" in b" ".join(argv))  # fmt: skip
    port = lines[node][lines[node].index(b"--port") + 1]
    clientapp = next(pid for pid, argv in lines.items() if b"127.0.0.1:" + port in argv)
    for pid in (node, clientapp) if supernode else (clientapp,):
        os.kill(pid, signal.SIGKILL)


def _deploy(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen([sys.executable, "-m", "pockengine", *args], env=env,
                                stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.slow
def test_a_lost_node_is_dropped_and_a_stopped_server_resumes(
    finetune: FinetuneConfig,  # noqa: F811
    tmp_path: Path,
) -> None:
    """2 SuperNodes; node 1 (its SuperNode and ClientApp) is killed during round 2. Round
    2 drops it (past --timeout, or as unavailable), later rounds go on with node 0 alone
    (round 4 is not even sent to node 1), and the server stops after round 4. --resume
    deploys afresh and runs round 5 with both nodes; no process is left."""
    marker = tmp_path / "flower-tmp"
    marker.mkdir()
    env = {**os.environ, "TMPDIR": str(marker), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = str(finetune.out)
    # client 1 sleeps in round 2, so it is still training when it is killed
    first = [*_args(finetune, out, rounds=5), "--timeout", "90", "--stop-after-round", "4",
             "--delay", "1:2:600"]  # fmt: skip
    command = _deploy(first, env, tmp_path / "first.log")
    try:
        end = time.monotonic() + 300
        rounds = Path(out) / "rounds.jsonl"
        while time.monotonic() < end and not (rounds.exists() and rounds.read_text()):
            assert command.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        _kill_node(with_marker(str(marker)), 1)
        assert command.wait(300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        command.kill()
    assert "node 1 is lost" in (tmp_path / "first.log").read_text()
    before = rounds_log(finetune)
    assert [(r["round"], r["clients"]) for r in before] == [
        (1, [0, 1]),
        *((r, [0]) for r in (2, 3, 4)),
    ]
    assert len(before[1]["dropped"]) == 1 and before[3]["dropped"] == []
    resumed = _deploy([*_args(finetune, out, rounds=5), "--resume", "--timeout", "120"], env,
                      tmp_path / "resumed.log")  # fmt: skip
    try:
        assert resumed.wait(300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        resumed.kill()
    after = rounds_log(finetune)
    assert after[:4] == before and (after[4]["round"], after[4]["clients"]) == (5, [0, 1])
    end = time.monotonic() + 10
    while with_marker(str(marker)) and time.monotonic() < end:
        time.sleep(0.2)
    assert with_marker(str(marker)) == []


@pytest.mark.slow
def test_a_killed_clientapp_process_is_restarted_and_its_node_comes_back(
    finetune: FinetuneConfig,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Node 1's ClientApp process (not its SuperNode) is killed while it sleeps in round
    2: the command starts a fresh one, round 2 goes on without node 1, and round 3 has
    both nodes again (the fresh process compiled once)."""
    marker = tmp_path / "flower-tmp"
    marker.mkdir()
    env = {**os.environ, "TMPDIR": str(marker), "PYTHONPATH": os.pathsep.join(sys.path)}
    out = str(finetune.out)
    args = [*_args(finetune, out, rounds=3), "--timeout", "120", "--delay", "1:2:600"]
    command = _deploy(args, env, tmp_path / "run.log")
    try:
        end = time.monotonic() + 300
        rounds = Path(out) / "rounds.jsonl"
        while time.monotonic() < end and not (rounds.exists() and rounds.read_text()):
            assert command.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(10)  # node 1 has taken round 2's task and sleeps in it
        _kill_node(with_marker(str(marker)), 1, supernode=False)
        assert command.wait(500) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        command.kill()
    assert (
        "clientapp-1 exited with code -9; started a fresh one" in (tmp_path / "run.log").read_text()
    )
    rows = rounds_log(finetune)
    assert [(r["round"], r["clients"]) for r in rows] == [(1, [0, 1]), (2, [0]), (3, [0, 1])]
    logs = Path(out) / "deployment-logs"
    assert (logs / "clientapp-1.0.log").exists()
    assert (logs / "clientapp-1.log").read_text().count("client 1: compiled in") == 1
