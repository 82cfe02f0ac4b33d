"""Fusion planning (hvd_acp.fusion) and the flat buffers built from it."""
import pytest
import torch
from torch.testing import assert_close

import hvd_acp
from hvd_acp.compression import Phase, compute_dtype, orthonormalize_
from hvd_acp.fusion import make_layouts, plan_buckets

F32, F64 = torch.float32, torch.float64


def _layouts(specs, matrix_rank=4, min_compression_rate=2.0):
    return make_layouts(specs, matrix_rank, min_compression_rate, payload_dtype=compute_dtype)


def _mlp_specs(dtype=F32):
    return [("l0.weight", (64, 64), dtype), ("l0.bias", (64,), dtype),
            ("l1.weight", (64, 64), dtype), ("l1.bias", (64,), dtype),
            ("l2.weight", (10, 64), dtype), ("l2.bias", (10,), dtype)]


def _members(buckets):
    return [[s.name for s in b.slots] for b in buckets]


def _nbytes(layout, phase):
    return layout.payload_numel(phase) * torch.empty((), dtype=layout.dtype).element_size()


def test_layouts_classify_compressed_tensors():
    lay = {l.name: l for l in _layouts(_mlp_specs())}
    assert [n for n, l in lay.items() if l.compressed] == ["l0.weight", "l1.weight", "l2.weight"]
    assert (lay["l2.weight"].n, lay["l2.weight"].m, lay["l2.weight"].r) == (10, 64, 4)
    assert lay["l0.bias"].r == 0
    assert lay["l0.weight"].payload_numel(Phase.P) == 64 * 4
    assert lay["l2.weight"].payload_numel(Phase.Q) == 64 * 4
    assert lay["l2.weight"].payload_numel(Phase.DENSE) == 640
    assert lay["l1.bias"].payload_numel(Phase.Q) == 64


@pytest.mark.parametrize("phase", [Phase.P, Phase.Q, Phase.DENSE])
def test_threshold_zero_gives_one_buffer_per_tensor_in_backward_order(phase):
    layouts = _layouts(_mlp_specs())
    buckets = plan_buckets(layouts, phase, 0)
    assert _members(buckets) == [[l.name] for l in reversed(layouts)]
    for bucket, layout in zip(buckets, reversed(layouts)):
        assert bucket.numel == layout.payload_numel(phase)
        assert bucket.slots[0].shape == layout.payload_shape(phase)


@pytest.mark.parametrize("phase", [Phase.P, Phase.Q, Phase.DENSE])
def test_large_threshold_fuses_everything_with_contiguous_slots(phase):
    layouts = _layouts(_mlp_specs())
    (bucket,) = plan_buckets(layouts, phase, 1 << 40)
    by_name = {l.name: l for l in layouts}
    assert [s.name for s in bucket.slots] == [l.name for l in reversed(layouts)]
    offset = 0
    for slot in bucket.slots:
        assert slot.offset == offset
        assert slot.numel == by_name[slot.name].payload_numel(phase)
        assert slot.shape == by_name[slot.name].payload_shape(phase)
        offset += slot.numel
    assert bucket.numel == offset
    assert bucket.nbytes == offset * 4


def test_byte_target_is_scaled_by_the_compression_ratio():
    # Four 64x64 fp32 matrices: 16 KiB of gradient each, 1 KiB of factor each
    # (64 x 4) in either phase. An S-SGD threshold of two gradients must give
    # two tensors per buffer in every phase, not one buffer in P and Q.
    layouts = _layouts([(f"w{i}", (64, 64), F32) for i in range(4)])
    threshold = 2 * 64 * 64 * 4
    for phase in (Phase.DENSE, Phase.P, Phase.Q):
        assert _members(plan_buckets(layouts, phase, threshold)) == [["w3", "w2"], ["w1", "w0"]]


@pytest.mark.parametrize("phase", [Phase.P, Phase.Q, Phase.DENSE])
@pytest.mark.parametrize("threshold", [1000, 5000, 20000, 70000])
def test_every_full_buffer_just_reaches_the_scaled_target(phase, threshold):
    layouts = _layouts(_mlp_specs())
    by_name = {l.name: l for l in layouts}
    grad_bytes = sum(l.numel * 4 for l in layouts)
    payload_bytes = sum(_nbytes(l, phase) for l in layouts)
    target = threshold * payload_bytes / grad_bytes
    buckets = plan_buckets(layouts, phase, threshold)
    assert [n for ms in _members(buckets) for n in ms] == [l.name for l in reversed(layouts)]
    for i, bucket in enumerate(buckets):
        sizes = [_nbytes(by_name[s.name], phase) for s in bucket.slots]
        assert sum(sizes[:-1]) < target
        if i < len(buckets) - 1 and sum(sizes) < target:
            # Closed early: the next buffer is one tensor that fills it alone.
            following = buckets[i + 1].slots
            assert len(following) == 1
            assert _nbytes(by_name[following[0].name], phase) >= target
        elif i < len(buckets) - 1:
            assert sum(sizes) >= target


@pytest.mark.parametrize("phase", [Phase.P, Phase.DENSE])
def test_a_tensor_that_fills_a_buffer_alone_does_not_hold_back_the_ones_before_it(phase):
    # Backward order: three small matrices, then a tall one (a language
    # model's word embeddings, whose gradient comes last), whose P factor
    # and gradient are 16x a small one's. With a target of four small
    # payloads the three small ones would wait in the tall one's buffer.
    specs = [("emb", (1024, 64), F32), ("s2", (64, 64), F32),
             ("s1", (64, 64), F32), ("s0", (64, 64), F32)]
    layouts = _layouts(specs)
    by_name = {l.name: l for l in layouts}
    small, big = _nbytes(by_name["s0"], phase), _nbytes(by_name["emb"], phase)
    assert big == 16 * small
    grad_bytes = sum(l.numel * 4 for l in layouts)
    payload_bytes = sum(_nbytes(l, phase) for l in layouts)
    threshold = 4 * small * grad_bytes // payload_bytes
    assert _members(plan_buckets(layouts, phase, threshold)) == [["s0", "s1", "s2"], ["emb"]]
    # Below its own size the tall one still shares a buffer: [s0, s1, s2, emb]
    # fill one target of 19 small payloads.
    threshold = 19 * small * grad_bytes // payload_bytes
    assert _members(plan_buckets(layouts, phase, threshold)) == [["s0", "s1", "s2", "emb"]]
    # A buffer less than half full rides along: at a target of 7 small
    # payloads, three small ones (3/7) wait for the tall one.
    threshold = 7 * small * grad_bytes // payload_bytes
    assert _members(plan_buckets(layouts, phase, threshold)) == [["s0", "s1", "s2", "emb"]]


def test_names_are_deterministic_unique_and_contain_the_phase():
    names = {}
    for phase in (Phase.P, Phase.Q, Phase.DENSE):
        first = plan_buckets(_layouts(_mlp_specs()), phase, 3000, prefix="acp")
        again = plan_buckets(_layouts(_mlp_specs()), phase, 3000, prefix="acp")
        assert [b.name for b in first] == [b.name for b in again]
        assert len(first) > 1
        assert len({b.name for b in first}) == len(first)
        for bucket in first:
            parts = bucket.name.split(".")
            assert parts[0] == "acp"
            assert parts[1] == phase.value
            # The members are named, so different parameters give different names.
            assert bucket.slots[0].name in bucket.name
        names[phase] = {b.name for b in first}
    assert not names[Phase.P] & names[Phase.Q]
    assert not names[Phase.P] & names[Phase.DENSE]
    assert not names[Phase.Q] & names[Phase.DENSE]


def test_explicit_groups_become_their_own_buffers():
    layouts = _layouts(_mlp_specs())
    groups = [["l0.weight", "l2.weight"]]
    buckets = plan_buckets(layouts, Phase.P, 1 << 40, groups=groups)
    members = _members(buckets)
    assert sorted(map(sorted, members)) == sorted(
        [["l0.weight", "l2.weight"], ["l0.bias", "l1.bias", "l1.weight", "l2.bias"]])
    group_bucket = next(b for b in buckets if b.slots[0].name in ("l0.weight", "l2.weight"))
    # Within the group, backward order too.
    assert [s.name for s in group_bucket.slots] == ["l2.weight", "l0.weight"]


def test_buckets_are_ordered_by_when_their_last_member_is_ready():
    layouts = _layouts(_mlp_specs())
    position = {l.name: i for i, l in enumerate(reversed(layouts))}
    buckets = plan_buckets(layouts, Phase.Q, 0, groups=[["l2.bias", "l0.bias"]])
    completion = [max(position[s.name] for s in b.slots) for b in buckets]
    assert completion == sorted(completion)
    assert ["l2.bias", "l0.bias"] in _members(buckets)


def test_dtypes_are_never_mixed():
    specs = [("a", (32, 32), F32), ("b", (32,), F64), ("c", (32, 32), F64),
             ("d", (32,), F32), ("e", (16, 16), torch.float16)]
    layouts = _layouts(specs)
    by_name = {l.name: l for l in layouts}
    for phase in (Phase.P, Phase.Q, Phase.DENSE):
        for groups in (None, [["a", "b", "c"]]):
            buckets = plan_buckets(layouts, phase, 1 << 40, groups=groups)
            for bucket in buckets:
                assert {by_name[s.name].dtype for s in bucket.slots} == {bucket.dtype}
            assert sorted(n for ms in _members(buckets) for n in ms) == sorted(by_name)
        # fp16 gradients travel as fp32 payload.
        assert by_name["e"].dtype is F32
        assert len(plan_buckets(layouts, phase, 1 << 40)) == 2


def test_negative_threshold_is_rejected():
    with pytest.raises(ValueError, match="fusion_threshold_bytes"):
        plan_buckets(_layouts(_mlp_specs()), Phase.P, -1)


class _RecordingCommunicator(hvd_acp.LocalCommunicator):
    """Keeps a copy of every buffer as it was handed to all-reduce."""

    def __init__(self, scale=1.0):
        super().__init__(scale)
        self.sent = []

    def allreduce_async_(self, tensor, name):
        self.sent.append((name, tensor, tensor.clone()))
        return super().allreduce_async_(tensor, name)


@pytest.mark.parametrize("threshold", [0, 1 << 30])
def test_slots_are_views_of_the_flat_buffer_that_is_reduced(threshold):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(),
                                torch.nn.Linear(10, 3)).double()
    comm = _RecordingCommunicator(scale=2.0)
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        matrix_rank=2, fusion_threshold_bytes=threshold, communicator=comm)
    reducer = opt.reducer
    basis = {n: q.clone() for n, q in reducer.state.q_factors.items()}
    orthonormalize_(basis.values())
    model(torch.randn(5, 12, dtype=F64)).pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()

    plan = plan_buckets(list(reducer.layouts.values()), Phase.P, threshold)
    assert [name for name, _, _ in comm.sent] == [b.name for b in plan]
    for (_, flat, at_launch), bucket in zip(comm.sent, plan):
        assert flat.dim() == 1 and flat.numel() == bucket.numel
        for slot in bucket.slots:
            payload = at_launch[slot.offset:slot.offset + slot.numel].view(slot.shape)
            layout = reducer.layouts[slot.name]
            if layout.compressed:
                expected = local[slot.name].reshape(layout.n, layout.m) @ basis[slot.name]
            else:
                expected = local[slot.name]
            assert_close(payload, expected)
    # The reduction (here: times 2) happened in the flat buffer; the gradient
    # is read back from the very same slots.
    params = dict(model.named_parameters())
    for name in ("0.bias", "2.weight", "2.bias"):
        assert not reducer.layouts[name].compressed
        assert_close(params[name].grad, 2 * local[name])
    assert reducer.layouts["0.weight"].compressed
    assert_close(reducer.state.p_factors["0.weight"], 2 * local["0.weight"] @ basis["0.weight"])


class _OrderCommunicator(hvd_acp.LocalCommunicator):
    """Records the waits, and the parameters whose p.grad is already written."""

    def __init__(self, params):
        super().__init__()
        self.params, self.events = params, []
        self.names = {}

    def allreduce_async_(self, tensor, name):
        handle = super().allreduce_async_(tensor, name)
        self.names[id(handle)] = name
        return handle

    def synchronize(self, handle):
        done = sorted(n for n, p in self.params.items() if p.grad is not None)
        self.events.append((self.names[id(handle)], done))
        super().synchronize(handle)


def test_each_buffer_is_turned_into_gradients_before_the_next_wait():
    """step() reconstructs a buffer's gradients as soon as it arrives, while
    the buffers launched later (the first layers') are still in flight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(),
                                torch.nn.Linear(10, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3)).double()
    params = dict(model.named_parameters())
    comm = _OrderCommunicator(params)
    opt = hvd_acp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        matrix_rank=2, fusion_threshold_bytes=0, communicator=comm)
    model(torch.randn(5, 12, dtype=F64)).pow(2).sum().backward()
    for p in params.values():
        p.grad = None          # written again only by the reducer from here on
    opt.synchronize()
    plan = plan_buckets(list(opt.reducer.layouts.values()), Phase.P, 0)
    assert [name for name, _ in comm.events] == [b.name for b in plan]
    assert len(plan) == len(params)
    for index, (_, done) in enumerate(comm.events):
        # Waiting for buffer k: exactly the gradients of buffers 0..k-1 are written.
        assert done == sorted(s.name for b in plan[:index] for s in b.slots)
