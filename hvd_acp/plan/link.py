"""Link calibration files: the CPU cost per byte of a network stack.

The profile measures a collective's own work per byte (copies and the
reduction, :mod:`.profile`); it cannot see the kernel's network stack. On a
GPU cluster that stack runs mostly in the NIC (segmentation, checksums,
RDMA) and the term is small; on the benchmark's emulated network it is all
software (TCP over veth pairs, a bridge and token buckets) and runs on the
same cores as the ranks' compute: at 1-10 Gbit/s it is the largest part of
S-SGD's communication.

The repository's benchmark measures it (``python -m benchmarks
calibrate-link --out link.json``, root) and writes ``stack_s_per_byte``:
the CPU-seconds one byte costs, sent and received, per link rate. In a
ring all-reduce each rank sends and receives ``2(N-1)/N * n`` bytes, so it
is charged ``2(N-1)/N * n * stack_s_per_byte``
(:class:`.cost.Network.stack_s_per_byte`). This module reads such a file
(``--link-calibration``) and interpolates it at a link rate.

Without a calibration file the planner charges, on a CPU profile, what the
host's own TCP stack costs per byte: :func:`loopback_tcp_s_per_byte`, which
the profile measures by sending over 127.0.0.1 (a Gloo rank on a CPU node
sends its all-reduce through that kernel path too; the copies into and out
of the kernel are there on any TCP link, the emulated network's veth pairs,
bridge and token buckets come on top of them).
"""
from __future__ import annotations

import math
import socket
import threading
import time
from typing import Optional

from .profile_format import read_json

__all__ = ["LINK_FORMAT", "LINK_KIND", "loopback_tcp_s_per_byte", "read_link",
           "stack_s_per_byte"]

#: Format version of a link calibration file, and its ``kind``.
LINK_FORMAT = 1
LINK_KIND = "hvd-acp link calibration"


def read_link(path) -> dict:
    """A calibration file written by ``python -m benchmarks calibrate-link``, checked."""
    data = read_json(path, "link calibration")
    if not isinstance(data, dict):
        data = {}
    value = data.get("stack_s_per_byte")
    if data.get("kind") != LINK_KIND or not isinstance(value, (int, float)) \
            or value < 0:
        raise ValueError(f"{str(path)!r} is not a link calibration of python -m benchmarks "
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


def loopback_tcp_s_per_byte(nbytes: int = 256 << 20, chunk: int = 4 << 20,
                            timeout_s: float = 60.0) -> float:
    """CPU seconds per byte of a TCP transfer over 127.0.0.1, sender and
    receiver together (this process's CPU time over the bytes moved).

    The receiver is a thread of this process; both sides spend their time
    in the kernel's socket calls, which release the GIL. Every socket call
    gives up after ``timeout_s`` (``RuntimeError``), so a stuck transfer
    cannot hang a profile.
    """
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(timeout_s)
    port = server.getsockname()[1]
    received = [0]

    def receive() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(timeout_s)
            view = memoryview(bytearray(chunk))
            while received[0] < nbytes:
                try:
                    got = conn.recv_into(view)
                except OSError:
                    return
                if not got:
                    break
                received[0] += got

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    data = bytes(chunk)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
            started = time.process_time()
            for _ in range(nbytes // chunk):
                conn.sendall(data)
            thread.join(timeout=timeout_s)
            spent = time.process_time() - started
    except OSError as error:
        raise RuntimeError(f"loopback TCP transfer failed: {error}") from error
    finally:
        server.close()
    if thread.is_alive() or received[0] < nbytes // chunk * chunk:
        raise RuntimeError("loopback TCP transfer did not complete")
    return spent / (nbytes // chunk * chunk)
