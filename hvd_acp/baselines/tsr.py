"""A TSR-style optimizer under Horovod: each matrix's r x r core all-reduced, Adam in the core.

Per step ``t`` (:mod:`hvd_acp.baselines.maths` has the maths):

1. every matrix (a tensor of two or more dimensions viewed (n, m), for
   which the core and the sketches send fewer elements than the matrix)
   with bases takes the core of this rank's gradient on them,
   ``U^T G V`` (r, r); where ``t`` is a multiple of its refresh period
   (``t = 0`` included) also the sketches ``G Omega`` (n, r) and
   ``G^T Psi`` (m, r), from Gaussian draws every rank makes alike;
2. one Horovod all-reduce (average) of one buffer: every core, every
   sketch, and the gradients of the other tensors (float16 on the wire by
   default);
3. every rank steps each matrix by Adam in its core space on the averaged
   core (``lr``, ``betas``, ``eps`` and ``weight_decay`` of the parameter's
   group in the wrapped optimizer, the decay decoupled), back through the
   bases it was taken on; where the sketches came, the bases become the
   orthonormal bases of the averaged sketches and the core moments are
   rotated into them. At ``t = 0`` there are no bases yet: the matrices
   send their sketches only and do not step;
4. the wrapped optimizer steps the other tensors on their averaged
   gradients (it never sees the matrices).

Every rank applies the same update to the same weights and bases: the
replicas stay identical, bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..comm import Communicator
from ..horovod_broadcast import initialize_state_
from . import maths
from .settings import TSRSettings
from .wrapper import (BaselineOptimizer, dense_grad, hidden_grads, state_dtype,
                      weights_fingerprint)

__all__ = ["TSROptimizer", "embedding_parameter_names"]

#: Adam's betas and eps where the wrapped optimizer's group has none (SGD).
DEFAULT_BETAS = (0.9, 0.999)
DEFAULT_EPS = 1e-8


def embedding_parameter_names(model: nn.Module) -> List[str]:
    """The names (as ``model.named_parameters()`` gives them) of the weights
    of ``model``'s ``nn.Embedding`` and ``nn.EmbeddingBag`` modules: the
    ``embedding_names`` of :class:`TSROptimizer` for that model."""
    weights = [module.weight for module in model.modules()
               if isinstance(module, (nn.Embedding, nn.EmbeddingBag))]
    return [name for name, param in model.named_parameters()
            if any(param is weight for weight in weights)]


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """A tensor the method steps: its name, its position among the
    parameters (for the sketches' seed), its shape as a matrix, its core's
    side and its refresh period."""

    name: str
    index: int
    rows: int
    cols: int
    core_rank: int
    refresh_period: int

    def refreshes(self, step: int) -> bool:
        return step % self.refresh_period == 0


class TSROptimizer(BaselineOptimizer):
    """TSR-style training (Dang et al., arXiv 2602.08007) around a torch optimizer.

    Every matrix (a tensor of two or more dimensions, viewed as ``shape[0]``
    rows) keeps two orthonormal bases ``U`` (n, r) and ``V`` (m, r) and
    Adam's moments of its r x r core, identical on every rank; per step only
    the core of each rank's gradient, ``U^T G V``, is averaged, and every
    ``refresh_period`` steps two sketches of it, from which the bases are
    renewed. The update is Adam's in the core space, ``w -= lr * scale * U
    (M^ / (sqrt(S^) + eps)) V^T`` after the decoupled weight decay, with the
    ``lr``, ``betas``, ``eps`` and ``weight_decay`` of the tensor's group in
    ``optimizer`` (so LR schedulers apply; an optimizer without ``betas``
    gets ``(0.9, 0.999)`` and ``eps`` 1e-8). It changes the optimizer of the
    matrices: the wrapped one steps only the other tensors (1-D tensors, and
    matrices too small to gain: ``r^2 + (n + m) r / K >= n m``), on their
    exactly averaged gradients.

    Bytes per step and rank, sent and received alike (one all-reduce):
    ``r^2 + (n + m) r / K`` elements per matrix over a refresh period of
    ``K`` steps, plus the other tensors' elements, 2 bytes each in float16
    (:meth:`bytes_per_step`; :meth:`step_bytes` for one given step).

    Args:
        optimizer: the torch optimizer of the other tensors, whose groups give
            every tensor's ``lr``, ``betas``, ``eps`` and ``weight_decay``.
        named_parameters: ``(name, parameter)`` pairs, the same on every rank.
        core_rank, embedding_core_rank, refresh_period,
        embedding_refresh_period, scale, fp16_wire, seed, embedding_names: see
            :class:`~hvd_acp.baselines.settings.TSRSettings`; ``None`` takes
            the defaults (32, ``core_rank``, 10, ``refresh_period``, 1.0,
            True, 0, none).
        communicator: default Horovod's.

    Raises:
        ValueError: a bad setting, or an ``embedding_names`` entry that names
            no parameter of two or more dimensions (on every rank alike).
    """

    key = "tsr"

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *,
                 core_rank: Optional[int] = None, embedding_core_rank: Optional[int] = None,
                 refresh_period: Optional[int] = None,
                 embedding_refresh_period: Optional[int] = None, scale: Optional[float] = None,
                 fp16_wire: Optional[bool] = None, seed: Optional[int] = None,
                 embedding_names: Optional[Iterable[str]] = None,
                 communicator: Optional[Communicator] = None) -> None:
        try:
            settings = TSRSettings(core_rank, embedding_core_rank, refresh_period,
                                   embedding_refresh_period, scale, fp16_wire, seed,
                                   embedding_names).resolve()
        except (ValueError, TypeError) as exc:
            settings = exc
        super().__init__(optimizer, named_parameters, settings, communicator)
        s = settings
        matrices = {n for n, p in self.named_params if p.dim() >= 2}
        unknown = sorted(set(s.embedding_names) - matrices)
        if unknown:
            # Settings and parameters are agreed across ranks: every rank raises.
            self.close()
            raise ValueError(f"embedding_names {unknown} name no parameter of two or more "
                             "dimensions")
        #: The tensors the method steps, in the parameters' order.
        self.matrices: List[_Matrix] = []
        for index, (name, param) in enumerate(self.named_params):
            if param.dim() < 2:
                continue
            embedding = name in s.embedding_names
            rows, cols = maths.matrix_view(param.shape)
            period = s.embedding_refresh_period if embedding else s.refresh_period
            side = maths.core_rank_of(rows, cols,
                                      s.embedding_core_rank if embedding else s.core_rank)
            if maths.compresses(rows, cols, side, period):
                self.matrices.append(_Matrix(name, index, rows, cols, side, period))
        stepped = {m.name for m in self.matrices}
        params = dict(self.named_params)
        self.compressed = [(m.name, params[m.name]) for m in self.matrices]
        self.exact = [(n, p) for n, p in self.named_params if n not in stepped]
        group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        self._groups = {m.name: group_of[params[m.name]] for m in self.matrices}
        self._dtypes = {m.name: state_dtype(params[m.name]) for m in self.matrices}
        self.wire_dtype = torch.float16 if s.fp16_wire else functools.reduce(
            torch.promote_types, [state_dtype(p) for _, p in self.named_params], torch.float32)
        # Bases appear at the first refresh (step 0); moments and core steps from the start.
        self._bases: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._moments: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {
            m.name: tuple(params[m.name].new_zeros(m.core_rank, m.core_rank,
                                                   dtype=self._dtypes[m.name])
                          for _ in range(2)) for m in self.matrices}
        self._core_steps: Dict[str, int] = {m.name: 0 for m in self.matrices}

    # ------------------------------------------------------------------ step
    def _start_facts(self) -> dict:
        state = [t for pair in (*self._bases.values(), *self._moments.values()) for t in pair]
        return {"step_count": self.step_count,
                "weights": weights_fingerprint(p for _, p in self.named_params),
                "state": weights_fingerprint(state), "core_steps": dict(self._core_steps)}

    def initialize_state(self) -> None:
        # The wrapped optimizer steps only the exactly averaged tensors:
        # create its state for those alone, as training will.
        initialize_state_(self._optimizer, [p for _, p in self.exact])

    def _method_step(self):
        comm, step = self._comm, self.step_count
        started = time.perf_counter()
        with torch.no_grad():
            parts = []
            for matrix, (name, param) in zip(self.matrices, self.compressed):
                grad = self._grad_matrix(matrix, param)
                if name in self._bases:
                    parts.append(maths.project(grad, *self._bases[name]))
                if matrix.refreshes(step):
                    draws = maths.sketch_draws(
                        matrix.rows, matrix.cols, matrix.core_rank,
                        maths.sketch_seed(self.settings.seed, step, matrix.index),
                        grad.dtype, grad.device)
                    parts.extend(maths.sketches(grad, *draws))
            parts.extend(dense_grad(p, self.label, zeros=True) for _, p in self.exact)
            buffer = (torch.cat([part.reshape(-1).to(self.wire_dtype) for part in parts])
                      if parts else None)
        self._timed(started)
        if buffer is not None:
            refreshing = any(m.refreshes(step) for m in self.matrices)
            comm.synchronize(comm.allreduce_async_(
                buffer, f"{self.section}.{'refresh' if refreshing else 'cores'}"))
            self._apply(buffer, step)
        with hidden_grads(p for _, p in self.compressed):
            return self._optimizer.step()

    def _grad_matrix(self, matrix: _Matrix, param: torch.Tensor) -> torch.Tensor:
        """This rank's gradient of ``param`` as an (n, m) matrix in its state's dtype."""
        grad = dense_grad(param, self.label, zeros=True)
        return grad.reshape(matrix.rows, matrix.cols).to(self._dtypes[matrix.name])

    def _apply(self, averaged: torch.Tensor, step: int) -> None:
        """Step the matrices on the averaged cores, refresh their bases from
        the averaged sketches, and give the other tensors their averaged
        gradients; ``averaged`` is the step's buffer after the all-reduce."""
        started = time.perf_counter()
        offset = 0

        def take(count: int, dtype: torch.dtype) -> torch.Tensor:
            nonlocal offset
            part = averaged[offset:offset + count].to(dtype)
            offset += count
            return part

        with torch.no_grad():
            for matrix, (name, param) in zip(self.matrices, self.compressed):
                dtype, r = self._dtypes[name], matrix.core_rank
                old = self._bases.get(name)
                exp_avg, exp_avg_sq = self._moments[name]
                if old is not None:
                    core = take(r * r, dtype).view(r, r)
                    self._core_steps[name] += 1
                    group = self._groups[name]
                    maths.core_adam_(param, core, *old, exp_avg, exp_avg_sq,
                                     self._core_steps[name], lr=group["lr"],
                                     betas=group.get("betas", DEFAULT_BETAS),
                                     eps=group.get("eps", DEFAULT_EPS),
                                     weight_decay=group.get("weight_decay", 0.0),
                                     scale=self.settings.scale)
                if matrix.refreshes(step):
                    bases = (maths.orthonormal_basis(take(matrix.rows * r, dtype).view(-1, r)),
                             maths.orthonormal_basis(take(matrix.cols * r, dtype).view(-1, r)))
                    if old is not None:
                        self._moments[name] = maths.rotate_moments(exp_avg, exp_avg_sq,
                                                                   *old, *bases)
                    self._bases[name] = bases
            for _, param in self.exact:
                param.grad = take(param.numel(), param.dtype).view_as(param)
        assert offset == averaged.numel()
        self._timed(started)

    # ----------------------------------------------------------------- bytes
    def step_bytes(self, step: int) -> int:
        """Bytes this rank sends (and receives) at step ``step`` (0 first):
        the cores from step 1 on, the sketches at each refresh, the other
        tensors' gradients."""
        elements = sum(p.numel() for _, p in self.exact)
        for m in self.matrices:
            elements += (m.core_rank ** 2 if step > 0 else 0) + (
                (m.rows + m.cols) * m.core_rank if m.refreshes(step) else 0)
        return elements * self._wire_bytes()

    def bytes_per_step(self) -> Dict[str, float]:
        """Bytes this rank sends and receives per step over a refresh period
        (an all-reduce hands back what it was handed): ``r^2 + (n + m) r / K``
        elements per matrix plus the other tensors', in the wire's dtype."""
        elements = sum(p.numel() for _, p in self.exact) + sum(
            maths.elements_per_step(m.rows, m.cols, m.core_rank, m.refresh_period)
            for m in self.matrices)
        sent = elements * self._wire_bytes()
        return {"sent": sent, "received": sent}

    def expected_bytes_per_step(self) -> float:
        """Bytes this rank sends per step over a long run (:meth:`bytes_per_step`)."""
        return float(self.bytes_per_step()["sent"])

    def _wire_bytes(self) -> int:
        return torch.empty((), dtype=self.wire_dtype).element_size()

    # ----------------------------------------------------------- checkpoints
    def _method_state(self) -> dict:
        return {"bases": {n: {"U": u, "V": v} for n, (u, v) in self._bases.items()},
                "moments": {n: {"exp_avg": a, "exp_avg_sq": b}
                            for n, (a, b) in self._moments.items()},
                "core_steps": dict(self._core_steps)}

    def _check_section(self, section: dict) -> None:
        shapes = {m.name: (m.core_rank, m.core_rank) for m in self.matrices}
        moments = {n: tuple(state["exp_avg"].shape)
                   for n, state in section.get("moments", {}).items()}
        if moments != shapes:
            raise ValueError(f"this {self.label} state was saved with other matrices or core "
                             f"ranks ({moments} against {shapes}); load it with the model and "
                             "settings it was saved with")

    def _load_method_state(self, state: dict) -> None:
        params = dict(self.compressed)
        with torch.no_grad():
            def here(name: str, tensor: torch.Tensor) -> torch.Tensor:
                return tensor.detach().clone().to(device=params[name].device,
                                                  dtype=self._dtypes[name])
            self._bases = {n: (here(n, b["U"]), here(n, b["V"]))
                           for n, b in state["bases"].items()}
            self._moments = {n: (here(n, m["exp_avg"]), here(n, m["exp_avg_sq"]))
                             for n, m in state["moments"].items()}
            self._core_steps = {n: int(c) for n, c in state["core_steps"].items()}
