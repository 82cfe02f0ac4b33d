"""A DeMo-style optimizer under Horovod: error-fed momentum, DCT, top-k, all-gather, sign.

Per step (:mod:`hvd_acp.baselines.maths` has the maths):

1. every tensor of two or more dimensions: this rank's momentum, held as a
   DCT-II per chunk, decays and takes the gradient; the ``top_k``
   coefficients of each chunk are taken out of it (what stays is the error
   feedback) and packed, values and positions, with every other tensor's
   into one byte buffer;
2. one Horovod all-gather of those buffers and one all-reduce (average) of
   the 1-D tensors' gradients, both in flight at once;
3. every rank adds the ranks' coefficients in rank order, averages them,
   transforms them back and steps ``w -= lr * sign(.)`` after the decoupled
   weight decay ``w *= 1 - lr * weight_decay`` (``lr`` and
   ``weight_decay`` of the parameter's group in the wrapped optimizer);
4. the wrapped optimizer steps the 1-D tensors on their averaged gradients
   (it never sees the others).

Every rank applies the same update to the same weights: the replicas stay
identical, bit for bit.
"""
from __future__ import annotations

import math
import time
from typing import Dict, Iterable, Optional, Tuple

import torch

from ..comm import Communicator
from . import maths
from .settings import DeMoSettings
from ..horovod_broadcast import initialize_state_
from .wrapper import (BaselineOptimizer, dense_grad, hidden_grads, state_dtype,
                      weights_fingerprint)

__all__ = ["DeMoOptimizer"]


class DeMoOptimizer(BaselineOptimizer):
    """DeMo-style training (Peng, Kingma et al., arXiv 2411.19870) around a torch optimizer.

    Tensors of two or more dimensions (matrices, embeddings, convolution
    kernels) are trained by the method itself, their update ``-lr *
    sign(...)`` with the learning rate and weight decay of their group in
    ``optimizer`` (so LR schedulers apply); 1-D tensors (biases, norms) are
    averaged exactly and stepped by ``optimizer``.

    Bytes per step and rank: sent, ``top_k`` values (the momentum's dtype,
    at least float32) and ``top_k`` positions (one byte for chunks up to 256
    elements) per chunk, plus the 1-D gradients; received, every other
    rank's coefficients (N - 1 times as many) plus the averaged 1-D
    gradients. An all-gather's receive side grows with the number of ranks.

    Args:
        optimizer: the torch optimizer of the 1-D tensors, whose groups give
            every tensor's ``lr`` and ``weight_decay``.
        named_parameters: ``(name, parameter)`` pairs, the same on every rank.
        top_k, chunk_size, momentum_decay: see
            :class:`~hvd_acp.baselines.settings.DeMoSettings`; ``None`` takes
            the defaults (8, 64, 0.999).
        communicator: default Horovod's.
    """

    key = "demo"

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *,
                 top_k: Optional[int] = None, chunk_size: Optional[int] = None,
                 momentum_decay: Optional[float] = None,
                 communicator: Optional[Communicator] = None) -> None:
        try:
            settings = DeMoSettings(top_k, chunk_size, momentum_decay).resolve()
        except (ValueError, TypeError) as exc:
            settings = exc
        super().__init__(optimizer, named_parameters, settings, communicator)
        self.compressed = [(n, p) for n, p in self.named_params if p.dim() >= 2]
        self.exact = [(n, p) for n, p in self.named_params if p.dim() < 2]
        group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        self._groups = {n: group_of[p] for n, p in self.compressed}
        self._momentum: Dict[str, torch.Tensor] = {
            n: p.new_zeros(maths.num_chunks(p.numel(), settings.chunk_size), settings.chunk_size,
                           dtype=state_dtype(p)) for n, p in self.compressed}
        self._layout = maths.payload_layout(
            {n: tuple(p.shape) for n, p in self.compressed},
            {n: state_dtype(p) for n, p in self.compressed}, settings.top_k, settings.chunk_size)
        self._dct: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def dct(self, like: torch.Tensor) -> torch.Tensor:
        """The DCT-II matrix of a chunk, in ``like``'s dtype and device (made once)."""
        key = (like.dtype, like.device)
        if key not in self._dct:
            self._dct[key] = maths.dct_matrix(self.settings.chunk_size, like.dtype, like.device)
        return self._dct[key]

    def _start_facts(self) -> dict:
        return {"step_count": self.step_count,
                "weights": weights_fingerprint(p for _, p in self.named_params)}

    def initialize_state(self) -> None:
        # The wrapped optimizer steps only the 1-D tensors: create its state
        # for those alone, as training will.
        initialize_state_(self._optimizer, [p for _, p in self.exact])

    def _method_step(self):
        comm, s = self._comm, self.settings
        started = time.perf_counter()
        values, positions = [], []
        with torch.no_grad():
            for name, param in self.compressed:
                momentum = self._momentum[name]
                maths.accumulate_(momentum, dense_grad(param, self.label), s.momentum_decay,
                                  self.dct(momentum))
                where, kept = maths.select_(momentum, s.top_k)
                values.append(kept)
                positions.append(where.to(maths.index_dtype(s.chunk_size)))
            payload = maths.pack(values + positions) if self.compressed else None
            exact = (torch.cat([dense_grad(p, self.label, zeros=True).reshape(-1)
                                for _, p in self.exact]) if self.exact else None)
        self._timed(started)
        gathering = (comm.allgather_async(payload, "hvd_acp.demo.coefficients")
                     if payload is not None else None)
        reducing = comm.allreduce_async_(exact, "hvd_acp.demo.exact") if exact is not None else None
        if gathering is not None:
            self._apply_coefficients(comm.synchronize_allgather(gathering))
        if reducing is not None:
            comm.synchronize(reducing)
            offset = 0
            for _, param in self.exact:
                param.grad = exact[offset:offset + param.numel()].view_as(param).to(param.dtype)
                offset += param.numel()
        with hidden_grads(p for _, p in self.compressed):
            return self._optimizer.step()

    def _apply_coefficients(self, gathered: torch.Tensor) -> None:
        """Decode every rank's coefficients and step the compressed tensors."""
        started = time.perf_counter()
        blocks = gathered.view(self._comm.size(), -1)
        count = len(self.compressed)
        ranks = [maths.unpack(block, self._layout) for block in blocks]
        with torch.no_grad():
            for index, (name, param) in enumerate(self.compressed):
                momentum = self._momentum[name]
                update = maths.decode([(parts[count + index], parts[index]) for parts in ranks],
                                      momentum.shape[0], self.dct(momentum))
                group = self._groups[name]
                maths.sign_step_(param, update, lr=group["lr"],
                                 weight_decay=group.get("weight_decay", 0.0))
        self._timed(started)

    def bytes_per_step(self) -> Dict[str, int]:
        """What one step sends and receives on this rank (from the layout)."""
        ranks = self._comm.size()
        gather = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                     for shape, dtype in self._layout)
        exact = sum(p.numel() * p.element_size() for _, p in self.exact)
        return {"sent": gather + exact, "received": (ranks - 1) * gather + exact}

    def expected_bytes_per_step(self) -> float:
        """Bytes this rank sends per step (:meth:`bytes_per_step`)."""
        return float(self.bytes_per_step()["sent"])

    def _method_state(self) -> dict:
        return {"momentum": dict(self._momentum)}

    def _load_method_state(self, state: dict) -> None:
        with torch.no_grad():
            for name, momentum in state["momentum"].items():
                self._momentum[name].copy_(momentum)

