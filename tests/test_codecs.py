"""A compression scheme is a codec and nothing else (hvd_acp/codecs/).

A toy scheme, written here as a new scheme would be written in a module of
hvd_acp/codecs/: a fixed random sketch, ``P_i = A S`` on the initial ``Q``
(never refreshed), ``G = P S^T``, with error feedback. It is named in
:data:`hvd_acp.codecs.SCHEMES` and picked by the settings (here a subclass
of :class:`hvd_acp.Settings` whose ``scheme`` names it); the Horovod front end
and the DDP hook train with it unchanged, and what they send is its payload.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import hvd_acp
from hvd_acp.codecs import SCHEMES, Codec
from hvd_acp.compression import compress_, local_residual_, orthonormal_copies, reconstruct_

F64 = torch.float64


class SketchCodec(Codec):
    """``P_i = A S`` on a fixed orthonormal sketch ``S`` = orth(the initial Q)."""

    name, phase = "sketch", "sketch"

    def payload_rows(self, n, m):
        return n

    def reused(self, tensor):
        return (tensor.q,)              # never committed to: the initial factor

    def encode_(self, tensor, basis, out):
        compress_(None, tensor.error, basis, out)
        return out

    def residual_(self, tensor, basis, factor):
        local_residual_(tensor.error, factor, basis)

    def commit_(self, tensor, averaged):
        return tensor.p.copy_(averaged)

    def reconstruct_(self, tensor, factor, basis, target):
        reconstruct_(target, factor, basis)
        return (factor,)


class SketchSettings(hvd_acp.Settings):
    @property
    def scheme(self):
        return "sketch"


@pytest.fixture(autouse=True)
def sketch_scheme():
    SCHEMES["sketch"] = (SketchCodec(),)
    yield
    del SCHEMES["sketch"]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).to(F64)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g, dtype=F64)
    return x, (x[:, :4].argmax(1))


def _train(model, opt, steps=30):
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_the_horovod_front_end_trains_with_a_new_codec():
    model = _model()
    settings = SketchSettings(matrix_rank=8, min_compression_rate=1.0, step_ahead=0)
    opt = hvd_acp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                       named_parameters=model.named_parameters(),
                                       settings=settings,
                                       communicator=hvd_acp.LocalCommunicator())
    state = opt.reducer.state
    sketch = orthonormal_copies([state.tensors["0.weight"].q])[0].clone()
    assert opt.phase == "sketch" and state.codec.name == "sketch"
    losses = _train(model, opt)
    assert losses[-1] < 0.8 * losses[0], losses
    # What went on the wire is the codec's payload: n r of the first matrix,
    # the rest whole (the (4, 32) one would not pay at rank 4).
    per_step = sum(lay.payload_numel(SCHEMES["sketch"][0]) for lay in state.layouts.values())
    assert sorted(state.tensors) == ["0.weight"] and per_step == 32 * 8 + 32 + 4 * 32 + 4
    assert opt.comm_stats.bytes_sent == 30 * per_step * 8
    # The sketch stayed as it was: the codec's basis, not a front end's choice.
    assert torch.equal(orthonormal_copies([state.tensors["0.weight"].q])[0], sketch)
    opt.close()


def test_the_error_feedback_identity_holds_for_a_new_codec():
    state = hvd_acp.state.CompressionState(SketchSettings(matrix_rank=2).resolve())
    state.add("w", (12, 8), F64, torch.device("cpu"))
    tensor = state.tensors["w"]
    tensor.error.normal_(generator=torch.Generator().manual_seed(1))
    before = tensor.error.clone()
    grad = torch.randn(12, 8, dtype=F64, generator=torch.Generator().manual_seed(2))
    codec = state.begin_step()
    basis = state.bases(["w"])["w"]
    out = torch.empty(state.layouts["w"].payload_shape(codec), dtype=F64)
    state.encode_("w", grad, out, codec)
    torch.testing.assert_close(grad + before, out @ basis.t() + tensor.error)


def test_the_ddp_hook_trains_with_a_new_codec():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvd_acp.ddp

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            module = _model()
            model = DDP(module)
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            state = hvd_acp.ddp.ACPState(
                settings=SketchSettings(matrix_rank=8, min_compression_rate=1.0),
                named_parameters=module.named_parameters(), optimizer=opt)
            model.register_comm_hook(state, hvd_acp.ddp.acp_hook)
            losses = _train(model, opt)
            assert losses[-1] < 0.8 * losses[0], losses
            assert state.phase == "sketch" and state.step_count == 30
            state.close()
        finally:
            dist.destroy_process_group()
