"""Federated sparse fine-tuning on Flower: many clients, one compiled step each.

    pockengine federated --recipe minilm-bbc --clients 10 --rounds 10 \\
        --partition dirichlet --alpha 0.5 --out runs/fed

Each client is a Flower ``ClientApp`` (``client``) whose local training is one
PockEngine ``TrainStep`` compiled once per client process (``local``); it receives and
returns only the tensors its scheme trains (``payload``; partial-channel params as
their trained rows). The ``ServerApp`` (``server``) aggregates them with
``SparseFedAvg`` (``strategy``: weighted FedAvg, FedProx and FedAvgM (``server_step``)
as options; BatchNorm statistics recomputed by the clients and pooled: ``batchnorm``),
evaluates
centrally on the held-out split, logs every round and saves the global state for
``--resume``. ``engine`` runs it all on one machine, a process per client;
``deployment`` runs it under Flower's deployment engine (a local SuperLink and N
SuperNodes, each with a long-lived ClientApp process from ``node``); ``partition``
cuts the data (IID or Dirichlet). Needs Flower: ``pip install
'pockengine[federated]'``; this module imports none of it.
"""

from __future__ import annotations

from pockengine.federated.config import FederatedConfig, FederatedError

__all__ = ["FederatedConfig", "FederatedError"]
