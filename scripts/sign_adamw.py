"""AdamW whose matrices step by the sign of their gradient: the update of a study.

``examples/train_lm.py --update sign`` trains with :class:`SignAdamW`; the
frontier of scripts/lm_study.py runs it under ``--optimizer acp`` (the row
"ACP-SGD, P and Q in turn, sign update" of docs/convergence.md). It is
research code, not part of the example: the example loads this file only
under ``--update sign``.
"""
from __future__ import annotations

import torch

from hvd_acp.baselines.maths import sign_step_


class SignAdamW(torch.optim.AdamW):
    """AdamW for the 1-D tensors; every other tensor steps as the DeMo-style
    method does, ``w *= 1 - lr * weight_decay; w -= lr * sign(grad)``
    (:func:`hvd_acp.baselines.maths.sign_step_`, the DeMo-style method's own).

    Under ``hvd_acp.DistributedOptimizer`` this is ACP-SGD carrying DeMo's
    error-fed momentum: a rank's residual ``E`` takes the gradient each step
    and gives up what its factors send, which is DeMo's momentum with decay 1,
    compressed to alternating rank-r factors in the same hooks and fused
    all-reduces instead of a DCT top-k and an all-gather; the averaged
    factors step by their sign.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dim() < 2:
                    continue
                sign_step_(p, p.grad, lr=group["lr"], weight_decay=group["weight_decay"])
                hidden[p] = p.grad
                p.grad = None          # AdamW skips it
        try:
            super().step()
        finally:
            for p, grad in hidden.items():
                p.grad = grad
        return loss
