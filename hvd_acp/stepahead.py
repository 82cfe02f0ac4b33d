"""Step-ahead error feedback: each rank computes its gradient where its
residual will take the weights.

ACP-SGD projects each step's gradient onto a basis found from the previous
step. At a large learning rate with momentum the part that basis misses
waits in the error-feedback residual ``E`` and comes back steps later,
amplified by momentum: the method diverges where S-SGD trains (see
docs/convergence.md, "Why ACP-SGD diverged"). Computing the gradient at
``w - a * D_i`` instead of ``w``, where ``D_i`` is how far this rank's
residual ``E_i`` will eventually move the weights once it is paid (through
the learning rate and momentum: :func:`eventual_step`; see
:func:`.compression.step_ahead_shift`), lets the gradient see what the owed
residual will do, which removes the late feedback at no communication cost.

What a user sees: the parameters hold the true weights, identical on every
rank, everywhere but between a training forward pass and the end of its
backward pass, so evaluation, checkpoints and broadcasts are unchanged, and
a step the user skips (``GradScaler`` after an overflow) leaves the true
weights. The residuals are in the units of the gradients the front end
wrote; the user's rescaling of those before the update (``GradScaler``'s
``1 / scale``, clipping) is measured by :mod:`.rescaling` and applied to the
shift.

Cost: the shifted weights are written into a second buffer of each
compressed parameter (one pass: read ``w`` and ``E``, write ``w - shift``),
which then becomes the parameter's storage (``param.data``); removing the
shift puts the true weights' buffer back. Nothing is copied back, so the
true weights come back bit for bit, in 3 memory passes per step instead of
the 7 of a copy, an in-place shift and a copy back. A parameter that is a
view into a larger storage (cuDNN's flattened RNN weights, a flat buffer of
a sharded optimizer) keeps the copy: whatever holds that storage must see
the shift. The shift is applied by a module forward pre-hook at the first
forward pass, in training mode with gradients enabled, of a module that
holds the parameters after a step, and removed once backward has written
the gradients (:meth:`StepAhead.after_backward`, which the front ends call)
and again before the optimizer updates the true weights.
:meth:`StepAhead.true_weights` gives the true weights in the window between
a training forward and the end of backward.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.nn.modules.module import register_module_forward_pre_hook

from .compression import adaptive_shift_denom, step_ahead_shift

logger = logging.getLogger(__name__)

__all__ = ["StepAhead", "check_step_hooks", "eventual_step", "hook_optimizer_steps", "release"]


def _adaptive_denom(state: dict, group: dict, error: Tensor,
                    share: float) -> Optional[Tensor]:
    """Adam's divisor for a step on the residual ``error`` (in the
    parameter's shape; :func:`.compression.adaptive_shift_denom`), or None
    for SGD-like updates."""
    exp_avg_sq = state.get("exp_avg_sq")
    if exp_avg_sq is None or "betas" not in group:
        return None
    step = float(state.get("step", 0))
    if step <= 0:
        return None
    return adaptive_shift_denom(error, exp_avg_sq, group["betas"][1], step,
                                group.get("eps", 1e-8), share)


def eventual_step(group: dict, adaptive: bool) -> float:
    """How far one unit of gradient eventually moves a weight, over all later steps.

    Plain SGD: ``lr``. SGD with momentum ``beta`` and dampening ``d``: the
    momentum buffer keeps re-applying it, ``lr * (1 - d) / (1 - beta)`` in
    all. Adam-family updates (``adaptive``): ``lr`` (per element divided by
    ``sqrt(v_hat) + eps``, which the caller applies), since their first
    moment is an average, not a sum.
    """
    lr = float(group["lr"])
    if adaptive:
        return lr
    momentum = float(group.get("momentum", 0.0) or 0.0)
    if not 0.0 <= momentum < 1.0:
        return lr
    return lr * (1.0 - float(group.get("dampening", 0.0) or 0.0)) / (1.0 - momentum)


class StepAhead:
    """Applies and removes the step-ahead shift of the compressed parameters.

    Args:
        state: the :class:`~hvd_acp.state.CompressionState` whose residuals
            shift the parameters of the same names.
        params: name -> parameter, for every name of ``state``.
        optimizer: the torch optimizer that updates them (learning rates,
            and Adam's second moments for the adaptive shift).
        step_ahead: ``a``; 0 switches the mechanism off.
        share: returns this rank's part of an all-reduced result (1 where
            the front end averages; see :func:`.compression.step_ahead_shift`).
        included: False on a rank that sends nothing (outside the process
            set): it keeps no residual and is never shifted.
    """

    def __init__(self, state, params: Dict[str, Tensor], optimizer: torch.optim.Optimizer,
                 step_ahead: float, *, share: Callable[[], float] = lambda: 1.0,
                 included: bool = True):
        self.state = state
        self.params = params
        self.share = share
        self.included = included
        self.optimizer = optimizer
        self.step_ahead = float(step_ahead)
        #: A shift is owed before the next training forward pass.
        self.pending = False
        #: Inside an optimizer step whose hooks call before_update / after_step
        #: (a closure's backward passes must not arm the shift again).
        self.stepping = False
        # The residuals' units are read only where a shift uses them.
        state.rescaling.enabled = bool(self.step_ahead) and included
        #: name -> (shift in a swapped-in buffer, parameter version after the
        #: shift was written), for the parameters holding shifted weights now.
        self._applied: Dict[str, Tuple[bool, int]] = {}
        #: name -> the buffer not in the parameter now: the true weights while
        #: shifted (or their copy, see _owns_storage), the next shift's otherwise.
        self._spares: Dict[str, Tensor] = {}
        #: name -> (residual, its view in the parameter's shape).
        self._error_views: Dict[str, Tuple[Tensor, Tensor]] = {}
        self._handle = None
        # Modules seen by the forward pre-hook: whether they hold one of our
        # parameters (another model's forward must not shift ours).
        self._owners: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = \
            weakref.WeakKeyDictionary()
        self._param_ids = {id(p) for p in params.values()}
        if self.step_ahead:
            ref = weakref.ref(self)

            def before_forward(module, args):
                this = ref()
                if this is not None and this.pending and module.training \
                        and torch.is_grad_enabled() and this._owns(module):
                    this.apply()

            self._handle = register_module_forward_pre_hook(before_forward)

    def _owns(self, module: torch.nn.Module) -> bool:
        owns = self._owners.get(module)
        if owns is None:
            owns = self._owners[module] = any(
                id(p) in self._param_ids for p in module.parameters())
        return owns

    @property
    def active(self) -> bool:
        """Whether the parameters hold shifted weights now."""
        return bool(self._applied)

    def close(self) -> None:
        """Remove the forward pre-hook (after restoring the true weights)."""
        self.restore(warn=False)
        self.pending = False
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def armed(self) -> bool:
        """Whether a shift is owed after an update (step-ahead on, something
        compressed, this rank sending)."""
        return bool(self.step_ahead) and bool(self.state.tensors) and self.included

    def after_backward(self) -> None:
        """Backward has written this step's gradients: the true weights back.

        The next training forward pass shifts again even if the user skips
        the update (``GradScaler`` after an overflow), with the units last
        measured; :meth:`after_step` does the same after an update.
        """
        self.restore()
        if not self.stepping:
            self.pending = self.armed

    def before_update(self) -> None:
        """The optimizer is about to update the true weights from ``p.grad``:
        put them back, and measure how the user rescaled the written
        gradients (:meth:`.rescaling.GradientRescaling.measure`)."""
        self.restore()
        self.state.rescaling.measure(self.params)

    def after_step(self) -> None:
        """Called once the true weights were updated (or replaced by a
        checkpoint): shift before the next forward pass."""
        self.pending = self.armed

    def _groups(self) -> Dict[int, Tuple[dict, dict]]:
        found = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                found[id(param)] = (group, self.optimizer.state.get(param, {}))
        return found

    @torch.no_grad()
    def apply(self) -> None:
        """Shift every compressed parameter by ``a`` times where its residual leads.

        The shift is ``a * eventual_step * E`` (see :func:`eventual_step`),
        with ``E`` this rank's residual in applied-gradient units.
        """
        self.pending = False
        if self._applied:
            return
        # E in the optimizer's units: E * unit, where unit is the user's
        # rescaling of the written gradients (1 / scale under a GradScaler).
        share = self.share() / self.state.rescaling.unit
        groups = self._groups()
        for name, tensor in self.state.tensors.items():
            error, param = tensor.error, self.params[name]
            if not param.requires_grad or id(param) not in groups:
                continue
            group, state = groups[id(param)]
            denom = _adaptive_denom(state, group, self._shaped(name, error, param), share)
            scale = eventual_step(group, adaptive=denom is not None)
            if not scale:
                continue
            swap = _owns_storage(param)
            spare = self._spares.get(name)
            if spare is None or not _same_layout(spare, param):
                spare = self._spares[name] = torch.empty_like(param.data)
            true = param.data
            if swap:
                shifted = spare
            else:
                spare.copy_(true)                   # the true weights, kept aside
                shifted = true
            alpha = -scale * self.step_ahead / share
            if denom is None and error.dtype == param.dtype:
                # step_ahead_shift without denominator, fused: one pass.
                torch.add(true, self._shaped(name, error, param), alpha=alpha, out=shifted)
            elif denom is not None and error.dtype == param.dtype:
                torch.addcdiv(true, self._shaped(name, error, param), denom.view(param.shape),
                              value=alpha, out=shifted)
            else:
                if denom is not None:
                    denom = denom.reshape(error.shape).to(error.dtype)
                shift = step_ahead_shift(error, scale, self.step_ahead, share, denom)
                torch.sub(true, shift.view(param.shape).to(param.dtype), out=shifted)
            if swap:
                param.data = shifted
                self._spares[name] = true
            self._applied[name] = (swap, param._version)

    def _shaped(self, name: str, error: Tensor, param: Tensor) -> Tensor:
        """``error`` viewed in ``param``'s shape, the view made once per residual."""
        cached = self._error_views.get(name)
        if cached is None or cached[0] is not error or cached[1].shape != param.shape:
            cached = self._error_views[name] = (error, error.view(param.shape))
        return cached[1]

    @torch.no_grad()
    def restore(self, warn: bool = True) -> None:
        """Put the true weights back (bit for bit) where the shift was applied.

        A parameter written by the user after the shift (its version moved)
        keeps the user's value: that write wins.
        """
        for name, (swapped, version) in self._applied.items():
            param = self.params[name]
            if param._version == version:
                self._put_back(name, param, swapped)
            elif warn:
                logger.warning(
                    "parameter %r was modified between the forward pass and step(); "
                    "its step-ahead shift was not removed. Modify parameters only "
                    "between step() and the next forward pass, or inside "
                    "optimizer.true_weights()", name)
        self._applied.clear()

    def _put_back(self, name: str, param: Tensor, swapped: bool) -> None:
        """The true weights back into ``param``: its buffer swapped back in (no
        pass), or copied back where the parameter kept its storage."""
        spare = self._spares[name]
        if swapped:
            self._spares[name] = param.data
            param.data = spare
        else:
            param.copy_(spare)

    @contextlib.contextmanager
    def true_weights(self):
        """Within this context the parameters hold the true weights.

        Parameters written inside keep the written value as their true
        weights; the others get their shift back on exit. Where the shift
        lives in a buffer of its own (see the module's docstring) entering
        and leaving swap buffers and copy nothing, so this may be used
        between a forward pass and its backward pass.
        """
        saved = dict(self._applied)
        self._applied.clear()
        entered = {}
        with torch.no_grad():
            for name, (swapped, _) in saved.items():
                param = self.params[name]
                shifted = param.data if swapped else param.detach().clone()
                self._put_back(name, param, swapped)
                entered[name] = (param._version, shifted)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, (swapped, _) in saved.items():
                    param = self.params[name]
                    version, shifted = entered[name]
                    if param._version != version:
                        continue                    # written inside: that is the truth now
                    if swapped:
                        self._spares[name] = param.data
                        param.data = shifted
                    else:
                        param.copy_(shifted)        # the spare still holds the true weights
                    self._applied[name] = (swapped, param._version)


def check_step_hooks(optimizer) -> None:
    """Raise ``TypeError`` unless ``optimizer`` is a torch optimizer with the
    step hooks :func:`hook_optimizer_steps` registers."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        raise TypeError(
            f"optimizer is a {type(optimizer).__name__}, a wrapper without the step hooks "
            "of torch.optim.Optimizer (Accelerate's AcceleratedOptimizer is one): pass the "
            "torch optimizer it wraps (its .optimizer)")


def hook_optimizer_steps(optimizer: torch.optim.Optimizer, step_ahead: StepAhead) -> list:
    """Around every ``optimizer.step()`` of a torch optimizer nobody wraps (the
    DDP hook's): the update applies to the true weights, with the user's
    rescaling of the gradients measured first, and the next gradient is
    taken ahead of them again. Returns the hooks' handles.

    ``optimizer.step(closure)`` (PyTorch Lightning's automatic optimization,
    L-BFGS) runs the forward and backward passes inside the step: the true
    weights come back and the rescaling is measured once the closure has
    returned, before the update. The hooks hold ``step_ahead`` weakly: they
    do not keep it alive.
    """
    ref = weakref.ref(step_ahead)

    def update_after(closure):
        @functools.wraps(closure)
        def wrapped(*args, **kwargs):
            loss = closure(*args, **kwargs)
            this = ref()
            if this is not None:
                this.before_update()
            return loss
        return wrapped

    def before_step(opt, args, kwargs):
        # args are step()'s own: (optimizer, closure?).
        this = ref()
        if this is None:
            return None
        this.stepping = True
        if len(args) > 1 and callable(args[1]):
            return (args[0], update_after(args[1]), *args[2:]), kwargs
        if callable(kwargs.get("closure")):
            return args, dict(kwargs, closure=update_after(kwargs["closure"]))
        this.before_update()
        return None

    def after_step(opt, args, kwargs):
        this = ref()
        if this is not None:
            this.stepping = False
            this.after_step()

    return [optimizer.register_step_pre_hook(before_step),
            optimizer.register_step_post_hook(after_step)]


def release(step_ahead: StepAhead, handles: list) -> None:
    """Restore the true weights, remove the forward hook and ``handles``."""
    step_ahead.close()
    for handle in handles:
        handle.remove()


def _owns_storage(param: Tensor) -> bool:
    """Whether ``param`` is the whole of its storage, so that the storage may
    be swapped for another without anything else noticing."""
    data = param.data
    return (data.storage_offset() == 0
            and data.untyped_storage().nbytes() == data.numel() * data.element_size())


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)
