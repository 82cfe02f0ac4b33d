"""Horovod's Gloo rendezvous server, run on its own for hand-launched ranks.

``horovodrun`` starts this server inside itself and then reaches the hosts
with ssh. With emulated nodes (network namespaces) the driver launches every
rank itself, so it runs the server here, in the hub namespace of the
emulated network::

    ip netns exec HUB python -m hvd_acp.bench.rendezvous --np 2

prints ``port <n>`` once listening, then serves until stdin closes or
SIGTERM. Rank ``i`` runs on host ``node<i>`` with one slot, as
``horovodrun -H node0:1,node1:1`` would assign it (see :func:`slot_env`).
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Dict, List

__all__ = ["host_plan", "slot_env", "main"]


def host_plan(np: int) -> List:
    """Horovod's slot assignment for ``np`` hosts ``node<i>`` of one slot each."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    return get_host_assignments([HostInfo(f"node{i}", 1) for i in range(np)], np)


def slot_env(rank: int, np: int) -> Dict[str, str]:
    """The per-rank environment ``horovodrun --gloo`` would set (gloo_run.py)."""
    return {"HOROVOD_HOSTNAME": f"node{rank}", "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(np), "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
            "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": str(np)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_acp.bench.rendezvous")
    parser.add_argument("--np", type=int, required=True)
    args = parser.parse_args(argv)
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    server.init(host_plan(args.np))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()          # returns when the driver closes our stdin
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
