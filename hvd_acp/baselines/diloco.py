"""DiLoCo under Horovod: H local steps of the user's optimizer, then one outer step.

Each rank runs the wrapped optimizer (AdamW in the paper) on its own
gradients for ``inner_steps`` steps with no communication; then the ranks
all-reduce how far each moved from the weights of the last outer step and
those weights take one outer SGD step with Nesterov momentum
(:func:`hvd_acp.baselines.maths.outer_step_`); every replica restarts from
them. Between outer steps the replicas differ; after one they are
identical, bit for bit.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterable, Optional, Tuple

import torch

from ..comm import Communicator
from .maths import outer_step_
from .settings import DiLoCoSettings
from .wrapper import BaselineOptimizer, weights_fingerprint

__all__ = ["DiLoCoOptimizer"]


class DiLoCoOptimizer(BaselineOptimizer):
    """DiLoCo (Douillard et al., arXiv 2311.08105) around any torch optimizer.

    ``optimizer.step()`` is one inner step of this rank's replica; every
    ``inner_steps``-th call also runs :meth:`outer_step`, a collective: one
    Horovod all-reduce per tensor of the mean outer gradient (Horovod fuses
    them), ``bytes(parameters)`` per rank, i.e. ``1 / inner_steps`` of
    S-SGD's bytes per step. Call :meth:`outer_step` yourself to end a run on
    one, as the examples do after their last step, and evaluate inside
    :meth:`global_weights` in between (the replicas differ there).

    The weights of the last outer step and the outer momentum are taken at
    the first ``step()``: call ``hvd.broadcast_parameters`` before it (the
    first step checks that every rank starts from the same weights, and raises
    on every rank otherwise). The wrapped optimizer's state stays each rank's
    own, as in the paper.

    Args:
        optimizer: the inner optimizer; its learning rate and schedule are
            the inner ones (the outer learning rate is constant).
        named_parameters: ``(name, parameter)`` pairs, the same on every rank.
        inner_steps, outer_lr, outer_momentum, nesterov: see
            :class:`~hvd_acp.baselines.settings.DiLoCoSettings`; ``None`` takes
            the paper's (500, 0.7, 0.9, True).
        communicator: default Horovod's (average over all ranks).
    """

    key = "diloco"

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None, *,
                 inner_steps: Optional[int] = None, outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                 communicator: Optional[Communicator] = None) -> None:
        try:
            settings = DiLoCoSettings(inner_steps, outer_lr, outer_momentum, nesterov).resolve()
        except (ValueError, TypeError) as exc:
            settings = exc
        super().__init__(optimizer, named_parameters, settings, communicator)
        #: Inner steps since the last outer step (identical on every rank).
        self.pending_inner_steps = 0
        self.outer_step_count = 0
        self._global: Optional[Dict[str, torch.Tensor]] = None
        self._momentum: Dict[str, torch.Tensor] = {}

    def _take_global(self) -> Dict[str, torch.Tensor]:
        if self._global is None:
            self._global = {n: p.detach().clone() for n, p in self.named_params}
        return self._global

    def _start_facts(self) -> dict:
        weights = self._global.values() if self._global is not None else (
            p for _, p in self.named_params)
        return {"step_count": self.step_count, "outer_step_count": self.outer_step_count,
                "weights": weights_fingerprint(weights),
                "momentum": weights_fingerprint(self._momentum.values())}

    def _method_step(self):
        self._take_global()
        result = self._optimizer.step()
        self.pending_inner_steps += 1
        if self.pending_inner_steps >= self.settings.inner_steps:
            self.outer_step()
        return result

    def outer_step(self) -> None:
        """Average the replicas' moves and take the outer step now (a collective:
        call on every rank). Every replica then holds the new global weights."""
        if not self._checked:
            self._check_start()
        global_weights = self._take_global()
        comm = self._comm
        with torch.no_grad():
            deltas = {n: global_weights[n] - p for n, p in self.named_params}
            handles = {n: comm.allreduce_async_(delta, f"hvd_acp.diloco.{n}")
                       for n, delta in deltas.items()}
            for handle in handles.values():
                comm.synchronize(handle)
            started = time.perf_counter()
            s = self.settings
            for name, param in self.named_params:
                buffer = outer_step_(global_weights[name], deltas[name],
                                     self._momentum.get(name), lr=s.outer_lr,
                                     momentum=s.outer_momentum, nesterov=s.nesterov)
                if buffer is not None:
                    self._momentum[name] = buffer
                param.copy_(global_weights[name])
            self._timed(started)
        self.pending_inner_steps = 0
        self.outer_step_count += 1

    @contextlib.contextmanager
    def global_weights(self):
        """Within this context the parameters hold the weights of the last
        outer step, identical on every rank (to evaluate or save them); this
        rank's replica comes back afterwards. No communication."""
        if self._global is None:
            yield
            return
        with torch.no_grad():
            local = {n: p.detach().clone() for n, p in self.named_params}
            for name, param in self.named_params:
                param.copy_(self._global[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.named_params:
                    param.copy_(local[name])

    def expected_bytes_per_step(self) -> float:
        """Bytes this rank sends per step over a long run: the parameters
        once every ``inner_steps`` steps (what :meth:`outer_step` all-reduces)."""
        total = sum(p.numel() * p.element_size() for _, p in self.named_params)
        return total / self.settings.inner_steps

    def _method_state(self) -> dict:
        return {"pending_inner_steps": self.pending_inner_steps,
                "outer_step_count": self.outer_step_count,
                "global": None if self._global is None else dict(self._global),
                "momentum": dict(self._momentum)}

    def _load_method_state(self, state: dict) -> None:
        self.pending_inner_steps = int(state["pending_inner_steps"])
        self.outer_step_count = int(state["outer_step_count"])
        with torch.no_grad():
            params = dict(self.named_params)
            self._global = None if state["global"] is None else {
                n: t.detach().clone().to(params[n].device) for n, t in state["global"].items()}
            self._momentum = {n: t.detach().clone().to(params[n].device)
                              for n, t in state["momentum"].items()}
