"""An emulated cluster network: one Linux network namespace per rank.

Topology (``np`` ranks, rate ``R``)::

    namespace <prefix>-<pid>-r0        namespace <prefix>-<pid>-hub       namespace <prefix>-<pid>-r1
    acp0 10.77.0.1/24  <--veth-->  b0 --[bridge br0 10.77.0.254]-- b1  <--veth-->  acp0 10.77.0.2/24
    tbf R on acp0                  tbf R on b0                     tbf R on b1     tbf R on acp0

Every rank is a node with its own NIC: a veth pair to a bridge in a hub
namespace, rate-limited with a token bucket (``tc qdisc ... tbf``) on both
ends, so each node can send ``R`` and receive ``R`` at the same time, like a
full-duplex link to a switch. Gloo (Horovod and torch.distributed) binds to
``acp0``, so all traffic between ranks crosses these links. Horovod's
rendezvous server runs in the hub namespace (``10.77.0.254``).

Horovod 0.28 binds the Gloo contexts of process sets (the global process
set included) to the address of the host name, not to ``HOROVOD_GLOO_IFACE``;
in a namespace the host name would resolve to 127.0.0.1, which the other
ranks cannot reach. Each rank's namespace therefore gets its own
``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` mounts over
``/etc/hosts``) mapping the host name to the rank's address.

Nothing is created outside the namespaces but those hosts files: the veth
ends are created directly inside the namespaces, and the subnet exists only
there. Deleting a namespace deletes its interfaces, bridge and qdiscs.
Names carry the driver's pid, so a later run removes the leftovers of a
crashed one (pid no longer alive) and never touches a live run's.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

from .stats import tbf_burst_bytes

logger = logging.getLogger(__name__)

__all__ = ["EmulatedNetwork", "NetworkSetupError", "check_can_emulate", "emulation_problem",
           "remove_leftovers"]

SUBNET = "10.77.0"
IFACE = "acp0"
DEFAULT_PREFIX = "hvdacp"
#: tbf queue: packets waiting longer than this are dropped (TCP backs off).
TBF_LATENCY_MS = 100
#: Per-namespace configuration files that ``ip netns exec`` mounts over /etc.
NETNS_ETC = Path("/etc/netns")


class NetworkSetupError(RuntimeError):
    """The emulated network cannot be built here (not root, no ip/tc, ...)."""


def check_can_emulate() -> None:
    """Raise :class:`NetworkSetupError` unless namespaces and tc can be used."""
    if os.geteuid() != 0:
        raise NetworkSetupError(
            "--bandwidth emulates the link with network namespaces and tc, which needs "
            "root: run as root (e.g. with sudo), or omit --bandwidth to run on localhost "
            "without emulation")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkSetupError(f"--bandwidth needs the iproute2 tools; not found: "
                                f"{', '.join(missing)} (apt-get install iproute2)")


def emulation_problem() -> Optional[str]:
    """Why the emulated network cannot be built here, or None when it can."""
    try:
        check_can_emulate()
    except NetworkSetupError as exc:
        return str(exc)
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkSetupError(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                                f"{proc.stderr.strip()}")
    return proc


def _namespaces() -> List[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Delete namespaces ``<prefix>-<pid>-*`` whose creator ``pid`` is dead.

    Returns the names deleted.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-(hub|r\d+)$")
    removed = []
    for name in _namespaces():
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    if NETNS_ETC.is_dir():
        for path in NETNS_ETC.iterdir():
            match = pattern.match(path.name)
            if match and not _pid_alive(int(match.group(1))):
                shutil.rmtree(path, ignore_errors=True)
        _remove_if_empty(NETNS_ETC)
    if removed:
        logger.warning("removed namespaces left by a crashed run: %s", ", ".join(removed))
    return removed


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


class EmulatedNetwork:
    """Namespaces, veths, bridge and qdiscs of one run; a context manager.

    Args:
        np: number of ranks (nodes).
        rate_mbit: link rate of every node, each direction, in Mbit/s.
        prefix: first component of the namespace names.
    """

    def __init__(self, np: int, rate_mbit: float, prefix: str = DEFAULT_PREFIX):
        if not 1 <= np <= 250:
            raise ValueError(f"np must be in [1, 250] for the emulated subnet, got {np}")
        self.np = np
        self.rate_mbit = rate_mbit
        self.prefix = prefix
        self.tag = f"{prefix}-{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.namespaces = [f"{self.tag}-r{i}" for i in range(np)]
        self.burst_bytes = tbf_burst_bytes(rate_mbit)
        self._created: List[str] = []
        self._etc_dirs: List[Path] = []

    # ----------------------------------------------------------- addresses
    hub_address = f"{SUBNET}.254"
    iface = IFACE

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: Optional[int] = None) -> List[str]:
        """``ip netns exec`` of rank ``rank``'s namespace (the hub's for None)."""
        return ["ip", "netns", "exec", self.hub if rank is None else self.namespaces[rank]]

    def describe(self) -> str:
        return (f"{self.np} network namespaces, one per rank ({self.address(0)}.."
                f"{self.address(self.np - 1)} on {self.iface}), each joined by its own "
                f"veth pair to a bridge in a hub namespace; tc tbf rate "
                f"{self.rate_mbit:g}mbit burst {self.burst_bytes} B latency {TBF_LATENCY_MS}ms "
                f"on both ends of every veth (each node sends and receives at "
                f"{self.rate_mbit:g} Mbit/s, full duplex); no added delay (netem is not "
                f"available); Horovod rendezvous server in the hub namespace "
                f"({self.hub_address})")

    # ------------------------------------------------------------ building
    def _tbf(self, namespace: str, device: str) -> None:
        _run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
              "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes),
              "latency", f"{TBF_LATENCY_MS}ms"])

    def setup(self) -> "EmulatedNetwork":
        check_can_emulate()
        remove_leftovers(self.prefix)
        try:
            self._add_namespace(self.hub)
            hub = ["ip", "-n", self.hub]
            _run(hub + ["link", "add", "br0", "type", "bridge"])
            _run(hub + ["addr", "add", f"{self.hub_address}/24", "dev", "br0"])
            _run(hub + ["link", "set", "br0", "up"])
            _run(hub + ["link", "set", "lo", "up"])
            for rank, namespace in enumerate(self.namespaces):
                self._add_namespace(namespace)
                port = f"b{rank}"
                # Both ends are created inside namespaces: nothing appears
                # in the namespace the driver runs in.
                _run(hub + ["link", "add", port, "type", "veth", "peer", "name", self.iface,
                            "netns", namespace])
                _run(hub + ["link", "set", port, "master", "br0"])
                _run(hub + ["link", "set", port, "up"])
                node = ["ip", "-n", namespace]
                _run(node + ["addr", "add", f"{self.address(rank)}/24", "dev", self.iface])
                _run(node + ["link", "set", self.iface, "up"])
                _run(node + ["link", "set", "lo", "up"])
                self._tbf(namespace, self.iface)      # node -> switch
                self._tbf(self.hub, port)             # switch -> node
                self._write_hosts(rank, namespace)
        except BaseException:
            self.teardown()
            raise
        logger.info("emulated network up: %s", self.describe())
        return self

    def _write_hosts(self, rank: int, namespace: str) -> None:
        """/etc/hosts of ``namespace``: this host's name is the rank's address."""
        directory = NETNS_ETC / namespace
        directory.mkdir(parents=True, exist_ok=True)
        self._etc_dirs.append(directory)
        nodes = "".join(f"{self.address(i)} node{i}\n" for i in range(self.np) if i != rank)
        (directory / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.address(rank)} {socket.gethostname()} node{rank}\n"
            f"{nodes}")

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def teardown(self) -> None:
        """Delete every namespace this object created (idempotent)."""
        while self._created:
            name = self._created.pop()
            _run(["ip", "netns", "del", name], check=False)
        while self._etc_dirs:
            shutil.rmtree(self._etc_dirs.pop(), ignore_errors=True)
        _remove_if_empty(NETNS_ETC)

    def __enter__(self) -> "EmulatedNetwork":
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()
