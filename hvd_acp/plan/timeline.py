"""Timeline of one training step per method, from a profile: pure Python.

Every time comes from the profile (see :mod:`.profile` for its fields) times
a compute scale (1 unless calibrated), and every all-reduce is priced by
:func:`.cost.allreduce_s`. One rank is simulated; every rank is assumed to
be identical, so a collective starts when this rank has submitted it.

- **S-SGD** (``hvd.DistributedOptimizer``): each gradient is handed to
  Horovod when it is ready in backward. Horovod's background thread wakes
  once per cycle (``HOROVOD_CYCLE_TIME``), takes every tensor submitted by
  then, fuses them up to ``HOROVOD_FUSION_THRESHOLD`` and runs the fused
  all-reduces one after the other; the next cycle starts one cycle after the
  last one started, or when its collectives are done if they took longer.
  ``step()`` waits for all, then the optimizer updates.
- **S-SGD in fp16** (``hvd.Compression.fp16``): the same, each gradient
  cast to float16 in its hook on the backward thread (half the bytes on
  the wire) and cast back in ``step()``, at the profile's
  ``fp16_cast_s_per_byte``.
- **ACP-SGD** (``hvd_acp.DistributedOptimizer``): the step orthonormalizes
  the reused factor at its first hook, then every hook compresses its
  gradient on the backward thread (delaying the rest of backward); a fused
  buffer of :func:`hvd_acp.fusion.plan_buckets` is submitted to Horovod's
  thread as soon as the factor of its last member to arrive is projected:
  that member's residual (``acp_p_residual_s``, ``acp_q_residual_s``) is
  computed after the launch, every other one right after its projection.
  A buffer closes early, at least half full of two or more tensors, before
  a tensor whose payload alone reaches the target (the plan's rule), so it
  is on the wire while that tensor's gradient is computed. ``step()`` takes the buffers
  in order and reconstructs each one's gradients as soon as it arrives. The
  profile's ``scheme`` says which steps: under SGD P and Q alternate (the
  figures are their mean); under an adaptive optimizer every step sends both
  factors on the bases of the step before (``acp_pq_s``, both bases
  orthonormalized at the first hook, ``reconstruct_pq_s``). With
  ``fp16_wire`` (the adaptive default) the hook that launches a buffer casts
  it to float16 first, half its bytes travel, and it is cast back before
  its reconstruction. With ``int8_factors`` the factors' buffers (``lanes``)
  send a byte an element plus a flag, four to an int32 word, packed by the
  launching hook and read back before the reconstruction
  (``lanes_s_per_element`` each way); the other tensors' buffers are cast
  as above. The default step-ahead
  error feedback shifts the compressed parameters before the forward pass
  and restores them in ``step()`` (``step_ahead_s``; 0 in profiles made
  before it was measured).
- **Power-SGD** (``hvd_acp.PowerSGDOptimizer``): the hooks compute the P
  factors and submit the P buffers; ``step()`` waits for all of them,
  orthonormalizes P, computes the Q factors, submits the Q buffers at once,
  waits, reconstructs and updates. It has its own rank (``psgd_r``; a
  smaller share under an adaptive optimizer) and its own fp16 casts
  (``psgd_fp16_wire``), and the same step-ahead shift (``step_ahead_s`` of
  the matrices it compresses), as for ACP-SGD.
- **Power-SGD, DDP hook** (``powerSGD_hook`` behind the benchmark's
  one-bucket-at-a-time wrapper): DDP's buckets, no Horovod cycle. When a
  bucket is ready the backward thread waits for the previous bucket's chain,
  computes the bucket's P factors and starts its uncompressed and P
  all-reduces; the chain then orthonormalizes, computes Q, all-reduces it and
  reconstructs. Backward's end waits for every chain.

- **ACP-SGD, DDP hook** (``hvd_acp.ddp.acp_hook``): DDP's buckets as DDP
  rebuilds them after its first iteration (in the order the gradients
  arrived, :mod:`.replan`), launched in that order, no Horovod cycle. When a
  bucket is ready the hook, on the backward thread, orthonormalizes its
  share of the reused factors, compresses the bucket's gradients (delaying
  the rest of backward) and starts one all-reduce of the bucket's factors
  and uncompressed tensors before the residual of its last compressed
  member, which it computes while the bucket travels; its callback rebuilds the
  gradients when the all-reduce is done. Backward's end waits for every
  bucket. P and Q steps alternate, or both factors go every step (on
  hvd_acp's own layouts), with fp16 on the wire where the profile says so
  (the hook's float16 copy of the payload and back); with ``int8_factors``
  a bucket's factors travel as 8-bit lanes in one all-reduce and its other
  tensors in a second, one after the other on the link; step-ahead shifts and
  restores as for ``hvd_acp.DistributedOptimizer``. The hook's kernels are
  scaled so that they add up to the hook's compression run for real
  (``ddp_hook_compression_s``), where the profile measured it.

Collectives of one job run one at a time on the link (Horovod's single
background thread; Gloo's queue for DDP). A collective Horovod runs in
float16 (fp16 S-SGD, and ACP-SGD's and Power-SGD's buffers with fp16 on the
wire) costs the profile's ``fp16_reduce_s_per_byte`` more host work per byte
moved than a float32 one: Horovod's Gloo path on a CPU reduces and averages
float16 element by element in software. The DDP hooks' collectives do not
pay it (torch's Gloo all-reduces float16 as fast as float32 per byte here).
On a link shaped by a token bucket (``Network.burst_bytes``, the benchmark's
emulated links) a collective's first bytes, as many as the bucket saved up
while the link idled, cross at once; the bucket refills at the link's rate
between collectives and, in the steady state :func:`predict_methods`
finds, over the idle end of the step before.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from ..lanes import words_for
from ..methods import REGISTRY, predicted
from .cost import Network, allreduce_s, link_bytes

__all__ = ["Settings", "StepPrediction", "HorovodThread", "predict_methods", "METHODS",
           "HOROVOD_FUSION_BYTES", "horovod_tiny_allreduce_s"]

#: Horovod's default HOROVOD_FUSION_THRESHOLD (64 MiB).
HOROVOD_FUSION_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a prediction is for.

    Attributes:
        np: number of ranks.
        network: the links and cost model.
        cycle_time_s: Horovod's cycle time (HOROVOD_CYCLE_TIME, default 1 ms).
        horovod_fusion_bytes: HOROVOD_FUSION_THRESHOLD.
        compute_scale: factor on every compute and compression time of the
            profile (and on its host cost per byte) for Horovod's methods.
        ddp_compute_scale: the same for the DDP hook (default compute_scale).
        cycle_phases: the cycle's phase relative to the step is unknown, so
            figures are averaged over this many evenly spaced phases.
        horovod_negotiation_s: Horovod's coordination at the start of every
            cycle that runs collectives (0 unless calibrated: the benchmark's
            tiny all-reduce probe, :mod:`.validate`).
        host_serial: the host's work on collectives (``host_s_per_byte``
            and ``stack_s_per_byte``) has no core of its own and delays
            computation: it is added to the step instead of lengthening each
            collective. True where
            every core runs a rank's compute (this machine: 2 ranks on 2
            cores); False where it runs beside it (a GPU node, where the
            host barely takes part anyway).
        link_idle_s: how long the link idled before the step began (the
            step before's :attr:`StepPrediction.link_tail_s`): how full a
            token bucket (``network.burst_bytes``) is at the step's start;
            unbounded (full) unless :func:`predict_methods` sets it.
    """

    np: int
    network: Network
    cycle_time_s: float = 0.001
    horovod_fusion_bytes: int = HOROVOD_FUSION_BYTES
    compute_scale: float = 1.0
    ddp_compute_scale: Optional[float] = None
    cycle_phases: int = 4
    host_serial: bool = False
    horovod_negotiation_s: float = 0.0
    link_idle_s: float = math.inf

    def __post_init__(self):
        if not isinstance(self.np, int) or self.np < 1:
            raise ValueError(f"np must be a positive int, got {self.np!r}")
        if self.cycle_time_s < 0:
            raise ValueError(f"cycle_time_s must be >= 0, got {self.cycle_time_s!r}")
        if not self.compute_scale > 0:
            raise ValueError(f"compute_scale must be > 0, got {self.compute_scale!r}")
        if self.cycle_phases < 1:
            raise ValueError(f"cycle_phases must be >= 1, got {self.cycle_phases!r}")
        if not self.link_idle_s >= 0:
            raise ValueError(f"link_idle_s must be >= 0, got {self.link_idle_s!r}")
        if self.horovod_negotiation_s < 0:
            raise ValueError(f"horovod_negotiation_s must be >= 0, got "
                             f"{self.horovod_negotiation_s!r}")


@dataclasses.dataclass
class StepPrediction:
    """One method's predicted step (seconds, bytes per rank).

    ``exposed_comm_s = step_s - compute_s - compression_s``: communication
    (and waiting for Horovod's cycle) not hidden behind computation.
    ``link_tail_s``: from the end of the step's last collective to the end
    of the step, the link's idle time before the next step.
    """

    step_s: float
    compute_s: float
    compression_s: float
    exposed_comm_s: float
    bytes_per_step: float
    allreduces_per_step: float
    link_busy_s: float
    link_tail_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class HorovodThread:
    """Horovod's background thread: cycles, fusion, one collective at a time.

    Args:
        cycle_s: cycle time; 0 runs every submission at once.
        fusion_bytes: the largest fused all-reduce.
        cost: seconds of an all-reduce of so many bytes (``cost(bytes)``;
            ``cost(bytes, True)`` for a float16 one).
        origin: time of one of the cycle's ticks.
        negotiation_s: coordination at the start of a cycle that has work.
    """

    def __init__(self, cycle_s: float, fusion_bytes: int, cost, origin: float = 0.0,
                 negotiation_s: float = 0.0):
        self.cycle_s = cycle_s
        self.negotiation_s = negotiation_s
        self.fusion_bytes = fusion_bytes
        self.cost = cost
        self.tick = origin
        self.busy_s = 0.0
        self.collectives = 0

    def _next_tick(self, at: float) -> float:
        if self.cycle_s <= 0:
            return max(self.tick, at)
        if at <= self.tick:
            return self.tick
        return self.tick + math.ceil((at - self.tick) / self.cycle_s - 1e-12) * self.cycle_s

    def submit(self, requests: Sequence[Tuple]) -> List[float]:
        """Finish times of ``(ready time, bytes)`` or ``(ready time, bytes,
        half)`` requests, in their order. Horovod fuses only tensors of one
        dtype: a float16 request (``half``) and a float32 one go in separate
        collectives, the float16 one priced as such (``cost(bytes, half)``)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i][0])
        finish = [0.0] * len(requests)
        k = 0
        while k < len(order):
            start = self._next_tick(requests[order[k]][0])
            batch = []
            while k < len(order) and requests[order[k]][0] <= start + 1e-12:
                batch.append(order[k])
                k += 1
            t = start + self.negotiation_s
            group, group_bytes, group_half = [], 0.0, False
            for i in batch + [None]:
                nbytes = requests[i][1] if i is not None else 0.0
                half = i is not None and len(requests[i]) > 2 and bool(requests[i][2])
                if group and (i is None or group_bytes + nbytes > self.fusion_bytes
                              or half != group_half):
                    duration = self._duration(t, group_bytes, group_half)
                    t += duration
                    self.busy_s += duration
                    self.collectives += 1
                    for j in group:
                        finish[j] = t
                    group, group_bytes = [], 0.0
                if i is not None:
                    group_half = half
                    group.append(i)
                    group_bytes += nbytes
            self.tick = max(start + self.cycle_s, t) if self.cycle_s > 0 else t
        return finish

    def _duration(self, start: float, nbytes: float, half: bool) -> float:
        at = getattr(self.cost, "at", None)     # a cost that knows the link's state
        if at is not None:
            return at(start, nbytes, half)
        return self.cost(nbytes, True) if half else self.cost(nbytes)


class _Costs:
    """Collective durations, and the host work set aside when it is serial.

    A float16 collective (``half``) costs the profile's
    ``fp16_reduce_s_per_byte`` more host work per byte moved (0 in a profile
    that did not measure it)."""

    def __init__(self, settings: Settings, scale: float, profile: Optional[dict] = None):
        self.np = settings.np
        net = settings.network
        self.full = net.scaled_host(scale)
        # The token bucket, in payload bytes; empty at the end of the last
        # collective before the step, which ended link_idle_s before it.
        self.burst = net.burst_bytes * net.wire_efficiency
        self.tokens, self.link_end = 0.0, -settings.link_idle_s
        extra = (profile or {}).get("fp16_reduce_s_per_byte", 0.0) * scale
        self.half = dataclasses.replace(self.full,
                                        host_s_per_byte=self.full.host_s_per_byte + extra)
        self.serial = settings.host_serial
        self.wire = self.full.wire_only() if self.serial else None
        self.host_s = 0.0

    def __call__(self, nbytes: float, half: bool = False) -> float:
        full = self.half if half else self.full
        if not self.serial:
            return allreduce_s(nbytes, self.np, full)
        wire = allreduce_s(nbytes, self.np, self.wire)
        self.host_s += allreduce_s(nbytes, self.np, full) - wire
        return wire

    def at(self, start: float, nbytes: float, half: bool = False) -> float:
        """:meth:`__call__` for a collective that starts at ``start``: the
        bytes the link's bucket saved up since its last collective cross at
        once."""
        duration = self(nbytes, half)
        if self.burst > 0 and nbytes > 0:
            rate = self.full.payload_bytes_per_s
            idle = max(0.0, start - self.link_end)
            self.tokens = min(self.burst, self.tokens + idle * rate)
            saved = min(self.tokens, link_bytes(nbytes, self.np, self.full))
            self.tokens -= saved
            duration = max(0.0, duration - saved / rate)
        if nbytes > 0:
            self.link_end = max(self.link_end, start + duration)
        return duration

    def tail(self, end: float) -> float:
        """The link's idle time from its last collective to ``end``."""
        return max(0.0, end - max(self.link_end, 0.0))


def _horovod_thread(settings: Settings, costs, origin: float) -> HorovodThread:
    return HorovodThread(settings.cycle_time_s, settings.horovod_fusion_bytes, costs, origin,
                         settings.horovod_negotiation_s)


def _phases(settings: Settings) -> List[float]:
    """The cycle's phases a prediction is averaged over."""
    if settings.cycle_time_s <= 0:
        return [0.0]
    return [settings.cycle_time_s * k / settings.cycle_phases
            for k in range(settings.cycle_phases)]


def horovod_tiny_allreduce_s(settings: Settings, nbytes: float = 4.0) -> float:
    """Predicted seconds from handing Horovod one tiny tensor to its result,
    averaged over the cycle's phases (the wait for the cycle, the
    negotiation, the collective)."""
    costs = _Costs(settings, settings.compute_scale)
    done = [_horovod_thread(settings, costs, o).submit([(0.0, nbytes)])[0]
            for o in _phases(settings)]
    return sum(done) / len(done) + costs.host_s / len(done)


def _backward_order(profile: dict) -> List[dict]:
    return sorted(profile["params"], key=lambda p: p["ready_s"])


def _hooked_backward(profile: dict, scale: float, start: float, first_cost: float,
                     hook_cost) -> Tuple[Dict[str, float], float]:
    """When each hook is done, and when backward ends, with hooks on its thread."""
    done, delay, t_prev = {}, first_cost * scale, 0.0
    for param in _backward_order(profile):
        delay += hook_cost(param) * scale
        done[param["name"]] = start + param["ready_s"] * scale + delay
        t_prev = param["ready_s"]
    end = start + max(profile["backward_s"], t_prev) * scale + delay
    return done, end


def _compute_s(profile: dict, scale: float) -> float:
    return (profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"]) * scale


def _by_name(profile: dict) -> Dict[str, dict]:
    return {p["name"]: p for p in profile["params"]}


def _cast_s_per_byte(profile: dict, fp16: bool) -> float:
    """Seconds per float32 byte of one cast to or from float16 on the wire
    (half the profile's round trip; 0 without fp16 or in a profile made
    before it was timed)."""
    return profile.get("fp16_cast_s_per_byte", 0.0) / 2 if fp16 else 0.0


def _wire_bytes(nbytes: float, fp16: bool) -> float:
    """Bytes on the wire of a float32 buffer of ``nbytes``."""
    return nbytes / 2 if fp16 else nbytes


def _lanes_wire_bytes(numel: float) -> float:
    """Bytes on the wire of ``numel`` 8-bit levels and their flag digit, four
    to an int32 word."""
    return 4 * words_for(numel + 1)


def _bucket_wire_bytes(bucket: dict, fp16: bool) -> float:
    """Bytes on the wire of one of the profile's fused buffers."""
    if bucket.get("lanes"):
        return _lanes_wire_bytes(bucket["bytes"] / 4)
    return _wire_bytes(bucket["bytes"], fp16)


def _bucket_cast_s(profile: dict, bucket: dict, cast: float) -> float:
    """One way of a buffer's conversion for the wire: its fp16 cast (``cast``
    seconds per float32 byte), or packing its 8-bit levels into words."""
    if bucket.get("lanes"):
        return profile.get("lanes_s_per_element", 0.0) * bucket["bytes"] / 4
    return cast * bucket["bytes"]


def _predict_ssgd(profile, settings, origin, fp16: bool = False) -> StepPrediction:
    s = settings.compute_scale
    costs = _Costs(settings, s, profile)
    thread = _horovod_thread(settings, costs, origin)
    start = profile["forward_s"] * s
    params = _backward_order(profile)
    # hvd.Compression.fp16: each gradient cast in its hook, on the backward
    # thread, and cast back in step().
    cast = _cast_s_per_byte(profile, fp16)
    done, bwd_end = _hooked_backward(profile, s, start, 0.0, lambda p: cast * p["bytes"])
    if not cast:
        # As S-SGD was predicted (and validated) before fp16: backward ends at
        # its measured end, not at its last gradient's hook where that is later.
        bwd_end = start + profile["backward_s"] * s
    finish = thread.submit([(done[p["name"]], _wire_bytes(p["bytes"], fp16), fp16)
                            for p in params])
    total = sum(p["bytes"] for p in params)
    end = (max([bwd_end] + finish) + cast * total * s + profile["optimizer_s"] * s
           + costs.host_s)
    compute = _compute_s(profile, s)
    compression = 2 * cast * total * s
    return StepPrediction(end, compute, compression, end - compute - compression,
                          _wire_bytes(total, fp16), thread.collectives, thread.busy_s,
                          costs.tail(end))


def _compressed_s(params: Dict[str, dict], key: str) -> float:
    """Sum of a per-parameter time over the compressed parameters."""
    return sum(p.get(key, 0.0) for p in params.values() if p["compressed"])


def _owed_s(param: dict, key: str) -> float:
    """The residual of ``param``'s step ``key`` (``acp_p_s``/``acp_q_s``),
    computed after a launch; 0 where the profile did not time it (an
    uncompressed tensor, or a profile made before it was timed)."""
    return min(param.get(key.replace("_s", "_residual_s"), 0.0), param.get(key, 0.0))


def _launching_members(buckets, done: Dict[str, float], profile: dict) -> List[str]:
    """Per buffer, the member whose hook launches it: the last to arrive."""
    order = {p["name"]: i for i, p in enumerate(_backward_order(profile))}
    return [max(b["members"], key=lambda n: (done[n], order[n])) for b in buckets]


def _launch_times(buckets, done: Dict[str, float], profile: dict, params: Dict[str, dict],
                  key: str, scale: float) -> List[float]:
    """When each fused buffer is submitted: once the factor of its last member
    to arrive is projected, before that member's residual."""
    return [done[last] - _owed_s(params[last], key) * scale
            for last in _launching_members(buckets, done, profile)]


def _backward_casting(profile: dict, scale: float, start: float, first_cost: float, hook_cost,
                      buckets, cast: float) -> Tuple[Dict[str, float], float]:
    """:func:`_hooked_backward` where, with fp16 on the wire (``cast`` seconds
    per float32 byte, 0 without), the hook that launches each of ``buckets``
    first casts it to float16 on the backward thread."""
    done, end = _hooked_backward(profile, scale, start, first_cost, hook_cost)
    if not cast and not any(b.get("lanes") for b in buckets):
        return done, end
    casts: Dict[str, float] = {}
    for name, bucket in zip(_launching_members(buckets, done, profile), buckets):
        casts[name] = casts.get(name, 0.0) + _bucket_cast_s(profile, bucket, cast)
    return _hooked_backward(profile, scale, start, first_cost,
                            lambda p: hook_cost(p) + casts.get(p["name"], 0.0))


def _acp_phases(profile: dict) -> Tuple[str, ...]:
    """The steps ACP-SGD's scheme goes through: ``("P", "Q")`` in turn, or
    ``("PQ",)``, both factors every step (the adaptive defaults)."""
    return ("PQ",) if profile.get("scheme") == "both" else ("P", "Q")


def _recon_key(phase: str) -> str:
    return "reconstruct_pq_s" if phase == "PQ" else "reconstruct_s"


def _predict_acp_phase(profile, settings, origin, phase: str) -> StepPrediction:
    s = settings.compute_scale
    costs = _Costs(settings, s, profile)
    params = _by_name(profile)
    key = f"acp_{phase.lower()}_s"
    orth = profile["orthonormalize_s"]["acp_" + phase.lower()]
    buckets = profile["buckets"]["acp_" + phase.lower()]
    fp16 = bool(profile.get("fp16_wire", False))
    cast = _cast_s_per_byte(profile, fp16)
    # Step-ahead error feedback (the default): the shift before the forward
    # pass and the restore at the start of step(), on the training thread.
    shift = _compressed_s(params, "step_ahead_s") * s
    start = profile["forward_s"] * s + shift

    done, bwd_end = _backward_casting(
        profile, s, start, orth, lambda p: p.get(key, 0.0) if p["compressed"] else 0.0,
        buckets, cast)
    thread = _horovod_thread(settings, costs, origin)
    launched = _launch_times(buckets, done, profile, params, key, s)
    finish = thread.submit([(at, _bucket_wire_bytes(b, fp16), fp16 and not b.get("lanes"))
                            for at, b in zip(launched, buckets)])
    t, recon = bwd_end, 0.0
    for bucket, arrived in zip(buckets, finish):
        r = (sum(params[n].get(_recon_key(phase), 0.0) for n in bucket["members"])
             + _bucket_cast_s(profile, bucket, cast)) * s
        t = max(t, arrived) + r
        recon += r
    t += profile["optimizer_s"] * s + costs.host_s
    compute = _compute_s(profile, s)
    compression = (shift + orth * s + _compressed_s(params, key) * s + recon
                   + sum(_bucket_cast_s(profile, b, cast) for b in buckets) * s)
    return StepPrediction(t, compute, compression, t - compute - compression,
                          sum(_bucket_wire_bytes(b, fp16) for b in buckets),
                          thread.collectives, thread.busy_s, costs.tail(t))


def _psgd_compressed(param: dict) -> bool:
    """Whether Power-SGD compresses ``param`` (at its own rank, where the
    profile has one)."""
    return bool(param.get("psgd_compressed", param["compressed"]))


def _psgd_reconstruct_s(param: dict) -> float:
    """Power-SGD's reconstruction of ``param`` (ACP-SGD's P and Q one in a
    profile made before Power-SGD had its own rank)."""
    return param.get("psgd_reconstruct_s", param.get("reconstruct_s", 0.0))


def _predict_powersgd(profile, settings, origin) -> StepPrediction:
    s = settings.compute_scale
    costs = _Costs(settings, s, profile)
    params = _by_name(profile)
    fp16 = bool(profile.get("psgd_fp16_wire", False))
    cast = _cast_s_per_byte(profile, fp16)
    p_buckets, q_buckets = profile["buckets"]["psgd_p"], profile["buckets"]["psgd_q"]
    # Step-ahead error feedback, as ACP-SGD's (the shift depends on the
    # matrix, not its rank): before the forward pass and in step().
    shift = sum(p.get("step_ahead_s", 0.0) for p in params.values() if _psgd_compressed(p)) * s
    start = profile["forward_s"] * s + shift

    done, bwd_end = _backward_casting(
        profile, s, start, 0.0,
        lambda p: p.get("psgd_p_s", 0.0) if _psgd_compressed(p) else 0.0, p_buckets, cast)
    thread = _horovod_thread(settings, costs, origin)
    finish = thread.submit([(max(done[n] for n in b["members"]), _wire_bytes(b["bytes"], fp16),
                             fp16) for b in p_buckets])
    compressed = [p for p in params.values() if _psgd_compressed(p)]
    p_bytes = sum(b["bytes"] for b in p_buckets)
    q_bytes = sum(b["bytes"] for b in q_buckets)
    middle = (profile["orthonormalize_s"]["psgd"] + sum(p["psgd_q_s"] for p in compressed)
              + cast * (p_bytes + q_bytes)) * s
    t = max([bwd_end] + finish) + middle
    finish = thread.submit([(t, _wire_bytes(b["bytes"], fp16), fp16) for b in q_buckets])
    recon = (sum(_psgd_reconstruct_s(p) for p in compressed)
             + cast * q_bytes) * s
    t = max([t] + finish) + recon + profile["optimizer_s"] * s + costs.host_s
    compute = _compute_s(profile, s)
    compression = (shift + sum(p["psgd_p_s"] for p in compressed) * s + cast * p_bytes * s
                   + middle + recon)
    nbytes = _wire_bytes(p_bytes + q_bytes, fp16)
    return StepPrediction(t, compute, compression, t - compute - compression, nbytes,
                          thread.collectives, thread.busy_s, costs.tail(t))


def _predict_powersgd_ddp(profile, settings) -> StepPrediction:
    s = settings.ddp_compute_scale or settings.compute_scale
    costs = _Costs(settings, s)
    params = _by_name(profile)
    n_compressed = sum(1 for p in params.values() if p["ddp_compressed"]) or 1
    start = profile["forward_s"] * s
    shift, chain_end, link_free = 0.0, -math.inf, -math.inf
    compression, nbytes, collectives, busy = 0.0, 0.0, 0, 0.0

    def run(at: float, size: float) -> float:
        nonlocal link_free, nbytes, collectives, busy
        if size <= 0:
            return at
        start = max(at, link_free)
        duration = costs.at(start, size)
        link_free = start + duration
        nbytes += size
        collectives += 1
        busy += duration
        return link_free

    last_ready = -math.inf
    for members in profile["ddp_buckets"]:
        ps = [params[n] for n in members]
        ready = max(last_ready, start + max(p["ready_s"] for p in ps) * s + shift)
        last_ready = ready
        hook = max(ready, chain_end)
        comp = [p for p in ps if p["ddp_compressed"]]
        p_cost = sum(p["psgd_p_s"] for p in comp) * s
        shift += hook - ready + p_cost
        t = hook + p_cost
        t = run(t, sum(p["bytes"] for p in ps if not p["ddp_compressed"]))
        t = run(t, sum(p["ddp_p_bytes"] for p in comp))
        if comp:
            middle = (profile["orthonormalize_s"]["psgd"] * len(comp) / n_compressed
                      + sum(p["psgd_q_s"] for p in comp)) * s
            t = run(t + middle, sum(p["ddp_q_bytes"] for p in comp))
            recon = sum(_psgd_reconstruct_s(p) for p in comp) * s
            t += recon
            compression += p_cost + middle + recon
        chain_end = t
    bwd_end = start + profile["backward_s"] * s + shift
    end = max(bwd_end, chain_end) + profile["optimizer_s"] * s + costs.host_s
    compute = _compute_s(profile, s)
    return StepPrediction(end, compute, compression, end - compute - compression, nbytes,
                          collectives, busy, costs.tail(end))


def _ddp_factors(profile: dict, phase: str):
    """Which matrices the DDP hook compresses and the float32 bytes of each
    one's factors in a ``phase`` step. Both factors: hvd_acp's own layouts
    (``compressed``, ``(n + m) r``); P and Q in turn: the profile's
    ``ddp_compressed`` and ``ddp_p_bytes``/``ddp_q_bytes``, as this
    prediction was validated."""
    if phase == "PQ":
        def nbytes(p):
            return (p["n"] + p["m"]) * p["r"] * (p["bytes"] // max(p.get("numel") or 1, 1))
        return (lambda p: bool(p["compressed"])), nbytes
    key = "ddp_p_bytes" if phase == "P" else "ddp_q_bytes"
    return (lambda p: bool(p["ddp_compressed"])), (lambda p: p[key])


def _predict_acp_ddp_phase(profile, settings, phase: str,
                           hook_scale: float = 1.0) -> StepPrediction:
    s = settings.ddp_compute_scale or settings.compute_scale
    # The DDP ranks compute faster without Horovod's thread; the hook's
    # compression does not (measured at 0.9-1.25x hvd_acp's on the
    # validation runs, never the compute's 0.8-0.9x): it keeps the
    # compute scale of the profile's kernels, times ``hook_scale``.
    c = settings.compute_scale * hook_scale
    costs = _Costs(settings, s)
    params = _by_name(profile)
    key = f"acp_{phase.lower()}_s"
    is_compressed, factor_bytes = _ddp_factors(profile, phase)
    fp16 = bool(profile.get("fp16_wire", False))
    cast = _cast_s_per_byte(profile, fp16)
    # int8_factors: a bucket's factors go as 8-bit lanes in one all-reduce,
    # its other tensors in a second.
    lanes = phase == "PQ" and bool(profile.get("int8_factors"))
    lanes_s = profile.get("lanes_s_per_element", 0.0)
    n_compressed = sum(1 for p in params.values() if is_compressed(p)) or 1
    orth = profile["orthonormalize_s"]["acp_" + phase.lower()]
    step_ahead = _compressed_s(params, "step_ahead_s") * settings.compute_scale
    start = profile["forward_s"] * s + step_ahead
    delay, link_free, arrived, compression = 0.0, -math.inf, -math.inf, step_ahead
    nbytes, collectives, busy, last_ready = 0.0, 0, 0.0, -math.inf
    for members in profile["ddp_buckets"]:
        ps = [params[n] for n in members]
        comp = [p for p in ps if is_compressed(p)]
        ready = max(last_ready, start + max(p["ready_s"] for p in ps) * s + delay)
        last_ready = ready
        rest = sum(p["bytes"] for p in ps if not is_compressed(p))
        if lanes:
            levels = sum((p["n"] + p["m"]) * p["r"] for p in comp)
            parts = [part for part in (_lanes_wire_bytes(levels) if comp else 0,
                                       _wire_bytes(rest, fp16)) if part]
            size, convert = rest, lanes_s * levels
        else:
            size = rest + sum(factor_bytes(p) for p in comp)
            parts, convert = [_wire_bytes(size, fp16)], 0.0
        # With fp16 on the wire the hook copies the payload into float16
        # before the launch, and back when it arrives.
        hook = (orth * len(comp) / n_compressed
                + sum(p.get(key, p.get("psgd_p_s", 0.0)) for p in comp) + cast * size
                + convert) * c
        delay += hook
        # The last compressed member's residual runs after the launch.
        owed = _owed_s(comp[-1], key) * c if comp else 0.0
        launched = max(ready + hook - owed, link_free)
        link_free = launched
        for part in parts:                       # one after the other on the link
            link_free += costs.at(link_free, part)
        duration = link_free - launched
        recon = (sum(p.get(_recon_key(phase), 0.0) for p in comp) + cast * size
                 + convert) * c
        arrived = max(arrived, link_free) + recon
        compression += hook + recon
        nbytes += sum(parts)
        collectives += len(parts)
        busy += duration
    bwd_end = start + profile["backward_s"] * s + delay
    end = max(bwd_end, arrived) + profile["optimizer_s"] * s + costs.host_s
    compute = _compute_s(profile, s)
    return StepPrediction(end, compute, compression, end - compute - compression, nbytes,
                          collectives, busy, costs.tail(end))


def _ddp_hook_scale(profile: dict, settings: Settings) -> float:
    """The DDP hook's compression as run for real (the profile's
    ``ddp_hook_compression_s``) over what its kernels add up to in this
    timeline at the profile's own scale; 1 in a profile without it."""
    measured = profile.get("ddp_hook_compression_s")
    if not measured:
        return 1.0
    unit = dataclasses.replace(settings, compute_scale=1.0, ddp_compute_scale=1.0)
    # What the hook's own clock counts: its compression less the step-ahead
    # shift, which the optimizer runs outside the hook.
    modeled = (_mean([_predict_acp_ddp_phase(profile, unit, ph)
                      for ph in _acp_phases(profile)]).compression_s
               - _compressed_s(_by_name(profile), "step_ahead_s"))
    return measured / modeled if modeled > 0 else 1.0


def _predict_acp_ddp(profile, settings) -> StepPrediction:
    """The DDP hook's steps, its kernels scaled once to its measured compression."""
    hook_scale = _ddp_hook_scale(profile, settings)
    return _mean([_predict_acp_ddp_phase(profile, settings, ph, hook_scale)
                  for ph in _acp_phases(profile)])


def _mean(preds: Sequence[StepPrediction]) -> StepPrediction:
    fields = [f.name for f in dataclasses.fields(StepPrediction)]
    return StepPrediction(**{f: sum(getattr(p, f) for p in preds) / len(preds) for f in fields})


#: How each method's step is simulated (the mean over the cycle's phases, and
#: for ACP-SGD over its alternating P and Q steps).
_PREDICTORS = {
    "ssgd": lambda profile, settings: _mean([_predict_ssgd(profile, settings, o)
                                             for o in _phases(settings)]),
    "ssgd-fp16": lambda profile, settings: _mean([_predict_ssgd(profile, settings, o, fp16=True)
                                                  for o in _phases(settings)]),
    "powersgd": lambda profile, settings: _mean([_predict_powersgd(profile, settings, o)
                                                 for o in _phases(settings)]),
    "powersgd-ddp": _predict_powersgd_ddp,
    "acp": lambda profile, settings: _mean([_predict_acp_phase(profile, settings, o, ph)
                                            for o in _phases(settings)
                                            for ph in _acp_phases(profile)]),
    "acp-ddp": lambda profile, settings: _predict_acp_ddp(profile, settings),
}
#: Methods predicted: those of :mod:`hvd_acp.methods` without a
#: ``not_predicted`` reason, in report order; each has its simulation above.
METHODS = predicted()
assert set(METHODS) <= set(_PREDICTORS), sorted(set(METHODS) - set(_PREDICTORS))


def predict_methods(profile: dict, settings: Settings,
                    methods: Sequence[str] = METHODS) -> Dict[str, StepPrediction]:
    """One predicted step per method (see the module docstring)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        reasons = "".join(f"; {m} is not predicted: {REGISTRY[m].not_predicted}"
                          for m in unknown if m in REGISTRY)
        raise ValueError(f"methods must be among {METHODS}, got {unknown}{reasons}")
    return {method: _steady(_PREDICTORS[method], profile, settings) for method in methods}


#: Steps simulated after the first to find how full a token bucket is when a
#: step begins (the idle end of the step before refills it).
STEADY_STEPS = 2


def _steady(predictor, profile: dict, settings: Settings) -> StepPrediction:
    """``predictor``'s step; on a link with a token bucket, the step that
    follows steps like it: each begins with what the step before's idle end
    saved up."""
    pred = predictor(profile, settings)
    if settings.network.burst_bytes > 0:
        for _ in range(STEADY_STEPS):
            pred = predictor(profile, dataclasses.replace(settings, link_idle_s=pred.link_tail_s))
    return pred
