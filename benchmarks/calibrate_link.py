"""``python -m benchmarks calibrate-link``: what moving a byte between two nodes costs the CPUs.

The planner's profile measures a collective's own work per byte; it cannot
see the kernel's network stack, which on this benchmark's emulated network
is all software (TCP over veth pairs, a bridge and token buckets) running
on the same cores as the ranks (see :mod:`hvd_acp.plan.link`).

The calibration builds the benchmark's own network
(:class:`.netem.EmulatedNetwork`, two nodes at ``rate``), sends ``nbytes``
from one node to the other over TCP in the 4 MiB chunks Gloo uses, and
reads the whole machine's busy CPU time (``/proc/stat``) over the
transfer, less what the machine used in an idle interval just before::

    stack_s_per_byte = (busy CPU-seconds during the transfer - idle rate * wall) / nbytes

One byte's cost covers sending it and receiving it (both ends of the
transfer, and the packet processing between them, whichever CPU ran it).
The file it writes is the planner's ``--link-calibration`` (``hvd-acp-plan
predict`` and ``validate``). It needs root, like ``--bandwidth``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hvd_acp.plan.link import LINK_FORMAT, LINK_KIND
from hvd_acp.plan.units import parse_bandwidth_list, positive_int

from .netem import EmulatedNetwork, NetworkSetupError, check_can_emulate
from .stats import machine_busy_s

__all__ = ["calibrate_link", "BusyMachine", "main"]

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
    return {"format": LINK_FORMAT, "kind": LINK_KIND,
            "network": "the benchmark's emulated network (benchmarks/netem.py), 2 nodes",
            "nbytes": nbytes, "chunk_bytes": chunk, "repeats": repeats,
            "idle_busy_cpus": idle_rate, "per_rate": per_rate,
            "stack_s_per_byte": statistics.median(r["stack_s_per_byte"] for r in per_rate),
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                     "python": platform.python_version()}}



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks calibrate-link",
        description="CPU cost per byte of the benchmark's emulated network (root), for "
                    "hvd-acp-plan's --link-calibration.")
    parser.add_argument("--rates", default="1gbit,10gbit",
                        help="link rates to measure at, comma-separated (default 1gbit,10gbit)")
    parser.add_argument("--megabytes", type=positive_int, default=256,
                        help="bytes sent per transfer, MiB (default 256)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="link.json to write")
    return parser


def _fail(message: str) -> int:
    print(f"python -m benchmarks calibrate-link: error: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        rates = parse_bandwidth_list(args.rates)
        link = calibrate_link(rates, nbytes=args.megabytes << 20, repeats=args.repeats)
    except (ValueError, NetworkSetupError) as exc:
        return _fail(str(exc))
    except BusyMachine as exc:
        print(f"python -m benchmarks calibrate-link: {exc}", file=sys.stderr)
        return 1
    link["command"] = ("python -m benchmarks calibrate-link "
                       + " ".join(shlex.quote(a) for a in argv))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(link, indent=1) + "\n")
    for row in link["per_rate"]:
        print(f"{row['rate_mbit']:g} Mbit/s: {row['stack_s_per_byte'] * 1e9:.2f} ns per byte "
              f"sent and received (achieved "
              f"{statistics.median(row['achieved_mbit']):.0f} Mbit/s)")
    print(f"wrote {args.out}")
    return 0
