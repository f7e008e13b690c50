"""The files a deployment run hands to Flower: the Flower App project that names our
server and client apps and carries the run's config (``write_app``), the Flower
configuration naming the local SuperLink (``write_connection``), and a free port."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from pockengine.federated.client import RUN_CONFIG_KEY
from pockengine.federated.config import FederatedConfig
from pockengine.federated.node import CLIENT_APP

__all__ = ["CONNECTION", "SERVER_APP", "free_port", "write_app", "write_connection"]

SERVER_APP = "pockengine.federated.server:app"
CONNECTION = "pockengine-local"

_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "pockengine-federated"
version = "1.0.0"
description = "A PockEngine federated run (written by pockengine federated --deployment)"
license = "MIT"
dependencies = []

[tool.flwr.app]
publisher = "pockengine"

[tool.flwr.app.components]
serverapp = "{server}"
clientapp = "{client}"

[tool.flwr.app.config]
{key} = {config}
"""


def write_app(folder: Path, config: FederatedConfig) -> Path:
    """A Flower App project whose run config carries ``config`` (as JSON); its folder."""
    folder.mkdir(parents=True, exist_ok=True)
    # JSON's string escapes are TOML's basic-string escapes, so the JSON text of the
    # JSON text is a valid TOML string
    text = _PYPROJECT.format(
        server=SERVER_APP,
        client=CLIENT_APP,
        key=RUN_CONFIG_KEY,
        config=json.dumps(config.to_json()),
    )
    (folder / "pyproject.toml").write_text(text)
    return folder


def write_connection(home: Path, address: str) -> Path:
    """A Flower configuration (``$FLWR_HOME/config.toml``) whose default SuperLink
    connection is ``address``, insecure; its path."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.toml"
    path.write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{address}"\ninsecure = true\n'
    )
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
