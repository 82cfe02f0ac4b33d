"""Horovod's Gloo rendezvous server, run on its own for hand-launched ranks.

``horovodrun`` starts this server inside itself and then reaches the hosts
with ssh. With emulated nodes (network namespaces) the driver launches every
rank itself, so it runs the server here, in the hub namespace of the
emulated network::

    ip netns exec HUB python -m benchmarks.rendezvous --np 2

prints ``port <n>`` once listening, then serves until stdin closes or
SIGTERM. Rank ``i`` runs on host ``node<i>`` with one slot, as
``horovodrun -H node0:1,node1:1`` would assign it (see :func:`slot_env`).
"""
from __future__ import annotations

import argparse
import select
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["host_plan", "slot_env", "rank_env", "start_server", "rank_commands", "main"]

#: Seconds to wait for the server to report its port.
START_TIMEOUT_S = 60.0


def host_plan(np: int) -> List:
    """Horovod's slot assignment for ``np`` hosts ``node<i>`` of one slot each."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    return get_host_assignments([HostInfo(f"node{i}", 1) for i in range(np)], np)


def slot_env(rank: int, np: int) -> Dict[str, str]:
    """The per-rank environment ``horovodrun --gloo`` would set (gloo_run.py)."""
    return {"HOROVOD_HOSTNAME": f"node{rank}", "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(np), "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
            "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": str(np)}


def rank_env(net, rank: int, port: int) -> Dict[str, str]:
    """What a rank of a Horovod job on node ``rank`` of ``net`` (an
    :class:`~benchmarks.netem.EmulatedNetwork`) needs: the per-slot
    variables of ``horovodrun --gloo``, the server in the hub, the node's
    interface for Gloo (and NCCL)."""
    return dict(slot_env(rank, net.np),
                HOROVOD_GLOO_RENDEZVOUS_ADDR=net.hub_address,
                HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
                HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
                HOROVOD_GLOO_IFACE=net.iface, NCCL_SOCKET_IFNAME=net.iface)


def start_server(net, python: str, env: Dict[str, str],
                 preexec_fn=None) -> Tuple[subprocess.Popen, int]:
    """Start this module's server in ``net``'s hub namespace.

    Returns the process and its port. Stop it by closing its stdin (then
    :func:`~benchmarks.launch.stop`). Raises ``RuntimeError`` with the
    server's output if it does not report a port within
    :data:`START_TIMEOUT_S`.
    """
    argv = net.exec_prefix() + [python, "-m", "benchmarks.rendezvous", "--np", str(net.np)]
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + START_TIMEOUT_S
    lines: List[str] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("port "):
                return proc, int(line.split()[1])
        elif proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError("the Horovod rendezvous server did not start in the hub namespace: "
                       + "".join(lines)[-2000:])


def rank_commands(net, argv: Sequence[str], env: Dict[str, str], port: int,
                  extra_env: Optional[Dict[str, str]] = None,
                  cwd: Optional[str] = None) -> List:
    """One :class:`~benchmarks.launch.Command` per rank: ``argv`` run in
    the rank's namespace (from ``cwd``), as ``horovodrun -np N -H
    node0:1,...`` would."""
    from .launch import Command
    return [Command(net.exec_prefix(rank) + list(argv),
                    dict(env, **rank_env(net, rank, port), **(extra_env or {})),
                    f"rank{rank}", cwd)
            for rank in range(net.np)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rendezvous")
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
