"""Cost model of one all-reduce: ring, or hierarchical for nodes of several GPUs.

Pure Python (no torch), so that a prediction needs only a profile file.

A ring all-reduce of ``n`` bytes over ``N`` ranks takes ``2(N-1)`` steps, in
each of which every rank sends and receives ``n / N`` bytes::

    t = 2(N-1) alpha + 2(N-1)/N * n / B + 2(N-1)/N * n * gamma

``alpha`` is the latency of one step, ``B`` the payload rate of one link
(the nominal rate times :attr:`Network.wire_efficiency`, the share of a
frame that is payload), and ``gamma`` the host's own cost per byte it sends
and receives (copies into and out of the fusion buffer, the reduction, the
network stack): the collective's own work measured by the profile on the
device (``host_s_per_byte``, see :mod:`.profile`) plus, between nodes, the
kernel's network stack (``stack_s_per_byte``, measured on the benchmark's
emulated network and read by :mod:`.link`; about 0 where the NIC does that
work). With ``G`` GPUs per node (``N = G * M``) the
hierarchical variant reduces inside each node first (a ring over ``G`` at
the intra-node rate), all-reduces across the ``M`` nodes (the node's link
carries all of its GPUs' shards) and gathers inside the node again.

A link shaped by a token bucket (``tc tbf``, as the benchmark's emulated
links, :attr:`Network.burst_bytes`) lets the bytes its bucket has saved up
while idle cross at once; :func:`link_bytes` is what a collective puts on a
node's link, from which the timeline draws the bucket.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["Network", "ETHERNET_PAYLOAD_SHARE", "ring_allreduce_s", "allreduce_s",
           "ring_allgather_s", "link_bytes"]

#: Payload share of a full Ethernet frame carrying TCP/IPv4 with timestamps:
#: 1448 payload bytes of the 1514 a 1500-byte MTU frame puts on the link.
ETHERNET_PAYLOAD_SHARE = 1448.0 / 1514.0


@dataclasses.dataclass(frozen=True)
class Network:
    """The network one job runs on.

    Attributes:
        bandwidth_mbit: nominal rate of each node's link, Mbit/s.
        latency_s: ``alpha``, the latency of one step of the ring, seconds.
        wire_efficiency: share of the nominal rate that carries payload.
        host_s_per_byte: the collective's own host seconds per byte sent and
            received (copies, reduction), scaled with compute.
        stack_s_per_byte: the network stack's CPU seconds per byte sent and
            received between nodes (``gamma`` is the sum of the two).
        gpus_per_node: ``G``; with ``G > 1`` all-reduces are hierarchical.
        intra_bandwidth_mbit: rate between the GPUs of one node (needed when
            ``gpus_per_node > 1``).
        intra_latency_s: ``alpha`` inside a node.
        burst_bytes: the token bucket of each node's link, each way (``tc
            tbf``'s burst, as on the benchmark's emulated links): bytes the
            link saves up while idle, at its rate, and lets through at once;
            0 (the default) for a link that only ever runs at its rate.
    """

    bandwidth_mbit: float
    latency_s: float = 0.0
    wire_efficiency: float = ETHERNET_PAYLOAD_SHARE
    host_s_per_byte: float = 0.0
    stack_s_per_byte: float = 0.0
    gpus_per_node: int = 1
    intra_bandwidth_mbit: Optional[float] = None
    intra_latency_s: float = 0.0
    burst_bytes: float = 0.0

    def __post_init__(self):
        if not (self.bandwidth_mbit > 0 and math.isfinite(self.bandwidth_mbit)):
            raise ValueError(f"bandwidth_mbit must be a positive number, got "
                             f"{self.bandwidth_mbit!r}")
        if self.latency_s < 0 or self.intra_latency_s < 0:
            raise ValueError(f"latencies must be >= 0, got {self.latency_s!r}, "
                             f"{self.intra_latency_s!r}")
        if not 0 < self.wire_efficiency <= 1:
            raise ValueError(f"wire_efficiency must be in (0, 1], got {self.wire_efficiency!r}")
        if self.host_s_per_byte < 0 or self.stack_s_per_byte < 0:
            raise ValueError(f"host_s_per_byte and stack_s_per_byte must be >= 0, got "
                             f"{self.host_s_per_byte!r}, {self.stack_s_per_byte!r}")
        if not (self.burst_bytes >= 0 and math.isfinite(self.burst_bytes)):
            raise ValueError(f"burst_bytes must be >= 0, got {self.burst_bytes!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive int, got {self.gpus_per_node!r}")
        if self.gpus_per_node > 1 and not (self.intra_bandwidth_mbit or 0) > 0:
            raise ValueError("gpus_per_node > 1 needs a positive intra_bandwidth_mbit, got "
                             f"{self.intra_bandwidth_mbit!r}")

    @property
    def payload_bytes_per_s(self) -> float:
        """Payload bytes per second of one node's link."""
        return self.bandwidth_mbit * 1e6 / 8 * self.wire_efficiency

    def scaled_host(self, factor: float) -> "Network":
        """This network with ``host_s_per_byte`` multiplied by ``factor``."""
        return dataclasses.replace(self, host_s_per_byte=self.host_s_per_byte * factor)

    def wire_only(self) -> "Network":
        """This network with no host or stack cost: the link alone."""
        return dataclasses.replace(self, host_s_per_byte=0.0, stack_s_per_byte=0.0)


def ring_moved(nbytes: float, ranks: int) -> float:
    """Bytes a ring all-reduce of ``nbytes`` per rank moves over each rank's
    link, each way: ``2(N-1)/N * nbytes``; 0 for one rank or no bytes."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes


def ring_allreduce_s(nbytes: float, ranks: int, bytes_per_s: float, latency_s: float,
                     host_s_per_byte: float = 0.0) -> float:
    """``2(N-1) alpha + 2(N-1)/N * nbytes * (1/B + gamma)``; 0 for one rank or no bytes."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks!r}")
    if ranks == 1 or nbytes <= 0:
        return 0.0
    moved = ring_moved(nbytes, ranks)
    return 2 * (ranks - 1) * latency_s + moved / bytes_per_s + moved * host_s_per_byte


def allreduce_s(nbytes: float, ranks: int, net: Network) -> float:
    """Seconds of one all-reduce of ``nbytes`` per rank over ``ranks`` ranks on ``net``.

    With ``net.gpus_per_node = G > 1`` and ``ranks > G`` (``ranks`` must then
    be a multiple of ``G``): reduce-scatter and all-gather inside the node
    (together one ring all-reduce over ``G`` at the intra-node rate) and a
    ring all-reduce across the ``ranks / G`` nodes of the whole buffer on each
    node's link (its ``G`` shards share it).
    """
    g = net.gpus_per_node
    if g == 1 or ranks == 1:
        return ring_allreduce_s(nbytes, ranks, net.payload_bytes_per_s, net.latency_s,
                                net.host_s_per_byte + net.stack_s_per_byte)
    intra_bps = net.intra_bandwidth_mbit * 1e6 / 8
    if ranks <= g:
        return ring_allreduce_s(nbytes, ranks, intra_bps, net.intra_latency_s,
                                net.host_s_per_byte)
    if ranks % g:
        raise ValueError(f"ranks ({ranks}) must be a multiple of gpus_per_node ({g})")
    nodes = ranks // g
    return (ring_allreduce_s(nbytes, g, intra_bps, net.intra_latency_s, net.host_s_per_byte)
            + ring_allreduce_s(nbytes, nodes, net.payload_bytes_per_s, net.latency_s,
                               net.host_s_per_byte + net.stack_s_per_byte))


def link_bytes(nbytes: float, ranks: int, net: Network) -> float:
    """Bytes one all-reduce of ``nbytes`` per rank puts on each node's link,
    each way: ``2(N-1)/N`` of them on a ring, the ring across the nodes of
    the whole buffer where ``net.gpus_per_node > 1`` (0 on one node)."""
    g = net.gpus_per_node
    return ring_moved(nbytes, ranks if g == 1 else (ranks // g if ranks > g else 1))


def ring_allgather_s(nbytes: float, ranks: int, net: Network) -> float:
    """Seconds of one ring all-gather of ``nbytes`` from each of ``ranks`` ranks on ``net``.

    ``N - 1`` steps, in each of which every rank sends and receives one
    rank's part: ``(N-1) alpha + (N-1) * nbytes * (1/B + gamma)``. Every
    rank's link carries ``N - 1`` parts each way, where an all-reduce's
    carries ``2(N-1)/N`` of its buffer. With ``gpus_per_node > 1`` the ring
    is priced on the links between nodes alone (an upper bound: the parts
    from the same node travel over its faster links).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks!r}")
    if ranks == 1 or nbytes <= 0:
        return 0.0
    moved = (ranks - 1) * nbytes
    return ((ranks - 1) * net.latency_s + moved / net.payload_bytes_per_s
            + moved * (net.host_s_per_byte + net.stack_s_per_byte))
