"""``hvd-acp-plan calibrate-link``: what moving a byte between two nodes costs the CPUs.

The profile measures a collective's own work per byte (copies and the
reduction, :mod:`.profile`); it cannot see the kernel's network stack. On a
GPU cluster that stack runs mostly in the NIC (segmentation, checksums,
RDMA) and the term is small; on the benchmark's emulated network it is all
software (TCP over veth pairs, a bridge and token buckets) and runs on the
same cores as the ranks' compute: at 1-10 Gbit/s it is the largest part of
S-SGD's communication.

The calibration builds the benchmark's own network
(:class:`hvd_acp.bench.netem.EmulatedNetwork`, two nodes at ``rate``), sends
``nbytes`` from one node to the other over TCP in the 4 MiB chunks Gloo
uses, and reads the whole machine's busy CPU time (``/proc/stat``) over the
transfer, less what the machine used in an idle interval just before::

    stack_s_per_byte = (busy CPU-seconds during the transfer - idle rate * wall) / nbytes

One byte's cost covers sending it and receiving it (both ends of the
transfer, and the packet processing between them, whichever CPU ran it).
In a ring all-reduce each rank sends and receives ``2(N-1)/N * n`` bytes,
so it is charged ``2(N-1)/N * n * stack_s_per_byte``
(:class:`.cost.Network.stack_s_per_byte`). It needs root, like the
benchmark's ``--bandwidth``.
"""
from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from ..bench.stats import machine_busy_s
from .profile_format import read_json

__all__ = ["calibrate_link", "LINK_FORMAT", "read_link", "stack_s_per_byte", "BusyMachine"]

LINK_FORMAT = 1
#: Busy CPUs (of the whole machine) above which the idle interval before
#: the transfers counts as disturbed: the subtraction would be meaningless.
MAX_IDLE_BUSY_CPUS = 0.25
#: Gloo's TCP transport writes a buffer in one go; 4 MiB is a typical fused chunk.
CHUNK_BYTES = 4 * 1024 * 1024
PORT = 29471


class BusyMachine(RuntimeError):
    """Other work keeps the machine's CPUs busy: the calibration cannot be trusted."""


_RECEIVER = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
buf = bytearray(int(sys.argv[3])); view = memoryview(buf); got = 0
while True:
    n = conn.recv_into(view)
    if not n:
        break
    got += n
conn.sendall(b"k"); conn.close()
print(got, flush=True)
"""

_SENDER = r"""
import socket, sys
total, chunk = int(sys.argv[3]), int(sys.argv[4])
data = memoryview(bytearray(b"\x01" * chunk))
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
sent = 0
while sent < total:
    s.sendall(data[:min(chunk, total - sent)]); sent += min(chunk, total - sent)
s.shutdown(socket.SHUT_WR)
assert s.recv(1) == b"k"
print(sent, flush=True)
"""


def _transfer(net, nbytes: int, chunk: int) -> Dict[str, float]:
    """One timed transfer from node 0 to node 1; CPU-seconds and wall seconds."""
    dst = net.address(1)
    receiver = subprocess.Popen(net.exec_prefix(1) + [sys.executable, "-c", _RECEIVER, dst,
                                                      str(PORT), str(chunk)],
                                stdout=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise RuntimeError("the receiver of the link calibration did not start")
        # The sender's interpreter start-up falls inside the timed interval;
        # calibrate_link subtracts it (_startup_busy_s).
        busy0, wall0 = machine_busy_s(), time.monotonic()
        sender = subprocess.run(net.exec_prefix(0) + [sys.executable, "-c", _SENDER, dst,
                                                      str(PORT), str(nbytes), str(chunk)],
                                capture_output=True, text=True, timeout=600)
        got = receiver.stdout.readline().strip()
        receiver.wait(timeout=60)
        busy1, wall1 = machine_busy_s(), time.monotonic()
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if sender.returncode != 0 or got != str(nbytes):
        raise RuntimeError(f"link calibration transfer failed (sender rc {sender.returncode}, "
                           f"received {got!r} of {nbytes} bytes): {sender.stderr[-500:]}")
    return {"busy_s": busy1 - busy0, "wall_s": wall1 - wall0}


def _startup_busy_s(net) -> float:
    """CPU time of the sender's interpreter doing nothing (subtracted)."""
    busy0 = machine_busy_s()
    subprocess.run(net.exec_prefix(0) + [sys.executable, "-c", "import socket, sys"],
                   check=True, timeout=60)
    return machine_busy_s() - busy0


def calibrate_link(rates_mbit: Sequence[float] = (1000.0, 10000.0), nbytes: int = 256 << 20,
                   repeats: int = 3, idle_s: float = 1.0, chunk: int = CHUNK_BYTES) -> dict:
    """Measure ``stack_s_per_byte`` on the benchmark's emulated network (see module doc)."""
    from ..bench.netem import EmulatedNetwork, check_can_emulate
    check_can_emulate()
    busy0, wall0 = machine_busy_s(), time.monotonic()
    time.sleep(idle_s)
    idle_rate = (machine_busy_s() - busy0) / (time.monotonic() - wall0)
    if idle_rate > MAX_IDLE_BUSY_CPUS:
        raise BusyMachine(f"other work kept {idle_rate:.2f} CPUs busy while the calibration "
                          "measured the idle machine; run it on a quiet machine")
    per_rate: List[dict] = []
    for rate in rates_mbit:
        with EmulatedNetwork(2, rate) as net:
            start = statistics.median(_startup_busy_s(net) for _ in range(repeats))
            runs = [_transfer(net, nbytes, chunk) for _ in range(repeats)]
            values = [max(0.0, r["busy_s"] - start - idle_rate * r["wall_s"]) / nbytes
                      for r in runs]
            per_rate.append({"rate_mbit": rate, "stack_s_per_byte": statistics.median(values),
                             "samples_s_per_byte": values,
                             "wall_s": [r["wall_s"] for r in runs],
                             "achieved_mbit": [nbytes * 8 / r["wall_s"] / 1e6 for r in runs]})
    return {"format": LINK_FORMAT, "kind": "hvd-acp link calibration",
            "network": "the benchmark's emulated network (hvd_acp.bench.netem), 2 nodes",
            "nbytes": nbytes, "chunk_bytes": chunk, "repeats": repeats,
            "idle_busy_cpus": idle_rate, "per_rate": per_rate,
            "stack_s_per_byte": statistics.median(r["stack_s_per_byte"] for r in per_rate),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                     "python": platform.python_version()}}


def read_link(path) -> dict:
    """A calibration file written by :func:`calibrate_link`, checked."""
    data = read_json(path, "link calibration")
    if not isinstance(data, dict):
        data = {}
    value = data.get("stack_s_per_byte")
    if data.get("kind") != "hvd-acp link calibration" or not isinstance(value, (int, float)) \
            or value < 0:
        raise ValueError(f"{str(path)!r} is not a link calibration of hvd-acp-plan "
                         "calibrate-link (no non-negative 'stack_s_per_byte')")
    return data


def stack_s_per_byte(link: Optional[dict], rate_mbit: float) -> float:
    """The calibration at ``rate_mbit``: interpolated on log(rate) between the
    measured rates, the nearest measured value outside them; 0 without one."""
    if not link:
        return 0.0
    rows = sorted(link.get("per_rate") or [], key=lambda r: r["rate_mbit"])
    if not rows:
        return float(link["stack_s_per_byte"])
    if rate_mbit <= rows[0]["rate_mbit"]:
        return float(rows[0]["stack_s_per_byte"])
    for lo, hi in zip(rows, rows[1:]):
        if rate_mbit <= hi["rate_mbit"]:
            w = (math.log(rate_mbit / lo["rate_mbit"])
                 / math.log(hi["rate_mbit"] / lo["rate_mbit"]))
            return float(lo["stack_s_per_byte"] * (1 - w) + hi["stack_s_per_byte"] * w)
    return float(rows[-1]["stack_s_per_byte"])
