"""``int8_factors``: the factors in 8-bit lanes (hvd_acp.lanes, hvd_acp.codecs.int8)."""
import pytest
import torch

import hvd_acp
from hvd_acp import lanes
from hvd_acp.codecs import Int8PQCodec, PQCodec
from hvd_acp.codecs.int8 import column_steps
from hvd_acp.comm import LocalCommunicator
from hvd_acp.fusion import plan_buckets
from hvd_acp.state import CompressionState
from tests.hvdrun import horovodrun, rank_lines, torchrun


# ------------------------------------------------------------------ lanes
@pytest.mark.parametrize("world", [1, 2, 3, 8, 16, 127])
@pytest.mark.parametrize("numel", [1, 3, 4, 5, 1000])
def test_a_sum_of_packed_words_holds_the_sums_of_the_levels(world, numel):
    g = torch.Generator().manual_seed(world * 1000 + numel)
    top = lanes.levels_per_rank(world)
    levels = [torch.randint(-top, top + 1, (numel,), generator=g).float() for _ in range(world)]
    levels[0][:1] = top            # extremes: every rank at +L, then at -L
    for level in levels[1:]:
        level[:1] = top
    words = [lanes.pack(level) for level in levels]
    assert all(w.dtype == torch.int32 and w.numel() == lanes.words_for(numel + 1) for w in words)
    total = torch.stack(words).sum(0, dtype=torch.int64)
    assert total.abs().max() < 2 ** 31                      # no int32 overflow
    assert torch.equal(lanes.unpack(total.to(torch.int32), numel), sum(levels))
    # In any order, partial sums included (a ring reduces them in turn).
    running = torch.zeros_like(words[0])
    for word in reversed(words):
        running = running + word
    assert torch.equal(lanes.unpack(running, numel), sum(levels))


def test_a_nan_on_one_rank_makes_the_whole_sum_nan():
    levels = [torch.zeros(9), torch.ones(9)]
    levels[1][4] = float("nan")
    total = lanes.pack(levels[0]) + lanes.pack(levels[1])
    assert torch.isnan(lanes.unpack(total, 9)).all()
    assert torch.equal(lanes.unpack(lanes.pack(levels[0]) * 2, 9), torch.zeros(9))


def test_quantize_rounds_clips_and_keeps_non_finite_as_nan():
    values = torch.tensor([0.26, -0.74, 5.0, -5.0, float("inf"), float("nan")])
    assert torch.equal(lanes.quantize_(values, torch.tensor(0.5), 3)[:4],
                       torch.tensor([1.0, -1.0, 3.0, -3.0]))
    assert torch.isnan(values[4:]).all()


def test_levels_per_rank():
    assert [lanes.levels_per_rank(n) for n in (1, 2, 8, 127)] == [127, 63, 15, 1]
    with pytest.raises(ValueError, match="at most 127 ranks"):
        lanes.levels_per_rank(128)
    with pytest.raises(ValueError, match="world_size"):
        lanes.levels_per_rank(0)


# ------------------------------------------------------------------ codec
def test_column_steps_scale_each_column_with_a_floor():
    factor = torch.tensor([[1.0, 0.0, -3.0], [-2.0, 0.0, 1.0]])
    steps = column_steps(factor, headroom=2.0, levels=4)
    assert torch.equal(steps, torch.tensor([[1.0, 3.0 / 256 * 0.5, 1.5]]))
    assert (column_steps(torch.zeros(3, 2), 2.0, 4) > 0).all()


def test_column_steps_follow_each_columns_growth_within_the_limit():
    factor = torch.tensor([[4.0, 1.0, -2.0], [0.0, -1.0, 1.0]])
    plain = column_steps(factor, headroom=2.0, levels=4)
    before = torch.tensor([[1.0, 2.0, 1.0]])       # grew 4x, shrank, grew 2x
    grown = column_steps(factor, 2.0, 4, before=before, max_growth=3.0)
    assert torch.equal(grown, plain * torch.tensor([[3.0, 1.0, 2.0]]))
    assert torch.equal(column_steps(factor, 2.0, 4, before=before, max_growth=1.0), plain)
    assert torch.equal(column_steps(factor, 2.0, 4, before=None, max_growth=3.0), plain)
    with pytest.raises(ValueError, match="max_growth"):
        Int8PQCodec(15, max_growth=0.5)


def test_the_steps_grow_with_the_averages_and_the_maxima_are_checkpointed():
    # Two 8-bit steps on one rank: the second's steps are the first's rule on
    # the new average times its growth; a checkpoint carries the maxima, and
    # a state loaded from it takes the same steps.
    state = _state(world=1)
    state.step_count = 1
    tensor, codec = state.tensors["w"], state.codec
    assert tensor.previous_maxima is None
    for scale in (1.0, 10.0):
        basis = state.bases(["w"])["w"]
        out = torch.empty(70, 3)
        state.encode_("w", scale * torch.randn(40, 30), out, codec, basis=basis)
        p_before = tensor.p.abs().amax(dim=0, keepdim=True)
        tensor.decode_(codec, out.clone(), basis, torch.empty(40, 30))
        assert torch.equal(tensor.previous_maxima[0], p_before)
        state._bases, state._bases_codec = {}, None
    growth = (tensor.p.abs().amax(dim=0, keepdim=True) / tensor.previous_maxima[0])
    assert (growth > 1).any()
    expected = column_steps(tensor.p, codec.headroom, codec.levels) * growth.clamp(1, codec.max_growth)
    assert torch.allclose(codec.steps(tensor)[0], expected)
    saved = state.state_dict(rank=0, world_size=1)
    assert set(saved["params"]["w"]) == {"P", "Q", "P_previous_maxima", "Q_previous_maxima",
                                         "error"}
    other = _state(world=1)
    other.load_state_dict(saved, rank=0)
    for mine, theirs in zip(codec.steps(tensor), other.codec.steps(other.tensors["w"])):
        assert torch.equal(mine, theirs)
    saved["params"]["w"]["P_previous_maxima"] = torch.ones(1, 4)
    with pytest.raises(ValueError, match="P_previous_maxima has shape"):
        other.load_state_dict(saved, rank=0)
    # A checkpoint from before the growth loads; its first 8-bit step takes none.
    del saved["params"]["w"]["P_previous_maxima"], saved["params"]["w"]["Q_previous_maxima"]
    other.load_state_dict(saved, rank=0)
    assert other.tensors["w"].previous_maxima is None
    assert torch.equal(other.codec.steps(other.tensors["w"])[0],
                       column_steps(tensor.p, codec.headroom, codec.levels))


def test_the_steps_are_worked_out_once_and_again_when_the_factors_change():
    # The encode's steps are the commit's (one reading of the column maxima a
    # step), but never stale: a factor changed in place gets new steps.
    state = _state(world=1)
    state.step_count = 1
    tensor, codec = state.tensors["w"], state.codec
    first = codec.steps(tensor)
    assert codec.steps(tensor)[0] is first[0]
    tensor.p.mul_(3.0)
    again = codec.steps(tensor)
    assert again[0] is not first[0]
    assert torch.equal(again[0], column_steps(tensor.p, codec.headroom, codec.levels))
    assert torch.equal(again[1], first[1])


def _state(world=2):
    settings = hvd_acp.Settings(matrix_rank=3, int8_factors=True, step_ahead=0).resolve()
    state = CompressionState(settings, world_size=world)
    state.add("w", (40, 30), torch.float32, torch.device("cpu"))
    return state


def test_the_first_compressed_step_sends_floats_then_8_bit_levels():
    state = _state(world=8)
    assert isinstance(state.codec, PQCodec) and not state.codec.lanes
    state.step_count = 1
    assert isinstance(state.codec, Int8PQCodec) and state.codec.levels == 15
    bucket, = plan_buckets(list(state.layouts.values()), state.codec, 10 ** 9)
    assert bucket.lanes


def test_a_new_world_size_makes_the_levels_again():
    # Elastic Horovod changes the ranks between steps: 63 levels for 2, 15 for 8
    # (at 63 levels eight ranks' digits would overflow their sum).
    state = _state(world=2)
    state.step_count = 1
    assert state.begin_step(2).levels == 63
    assert state.begin_step(8).levels == 15 and state.codec.levels == 15
    assert state.begin_step().levels == 15


def test_what_the_levels_leave_out_stays_in_the_residual():
    # One rank: A = (what the dequantized levels carry) + E after the step, exactly.
    state = _state(world=1)
    state.step_count = 1
    tensor = state.tensors["w"]
    tensor.p.normal_()
    tensor.q.normal_()
    grad = torch.randn(40, 30)
    codec = state.codec
    basis = state.bases(["w"])["w"]
    out = torch.empty(70, 3)
    before = tensor.error.clone()
    state.encode_("w", grad, out, codec, basis=basis)
    assert torch.equal(out, out.round()) and out.abs().max() <= codec.levels
    averaged = out.clone()
    target = torch.empty(40, 30)
    tensor.decode_(codec, averaged, basis, target)
    assert torch.allclose(grad + before, target + tensor.error, atol=1e-5)
    assert tensor.error.norm() > 0


def test_settings_errors():
    with pytest.raises(ValueError, match="needs both_factors"):
        hvd_acp.Settings(int8_factors=True, both_factors=False)
    with pytest.raises(ValueError, match="fixed matrix_rank"):
        hvd_acp.Settings(int8_factors=True, matrix_rank="auto")
    with pytest.raises(TypeError, match="int8_factors"):
        hvd_acp.Settings(int8_factors=1)
    with pytest.raises(ValueError, match="Power-SGD"):
        hvd_acp.Settings(int8_factors=True).resolve(factors_per_step=2)
    assert hvd_acp.Settings(int8_factors=True).resolve().both_factors


def test_one_process_trains_and_sends_a_byte_per_factor_element():
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = hvd_acp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2),
                                       named_parameters=net.named_parameters(),
                                       communicator=LocalCommunicator(), int8_factors=True,
                                       matrix_rank=2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    factors = sum((lay.n + lay.m) * lay.r for lay in opt.reducer.layouts.values()
                  if lay.compressed)
    before = opt.comm_stats.bytes_sent
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    others = sum(lay.numel for lay in opt.reducer.layouts.values() if not lay.compressed)
    assert opt.comm_stats.bytes_sent - before == 4 * lanes.words_for(factors + 1) + 4 * others


# ------------------------------------------------------- several processes
@pytest.mark.horovod
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 4, 8])
def test_the_ranks_levels_add_up_exactly_and_replicas_stay_identical(np):
    result = horovodrun("int8_cases.py", "sums", np=np, timeout=240)
    assert sorted(int(r) for r in rank_lines(result.stdout, "OK sums")) == list(range(np))


@pytest.mark.horovod
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 4])
def test_a_checkpoint_resumes_exactly(np):
    result = horovodrun("int8_cases.py", "resume", np=np, timeout=240)
    assert sorted(int(r) for r in rank_lines(result.stdout, "OK resume")) == list(range(np))


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np", [2, 4])
def test_the_ddp_hook_sends_the_factors_in_lanes_and_the_rest_as_floats(np):
    output = torchrun("int8_ddp.py", np=np, timeout=240)
    assert sorted(int(r) for r in rank_lines(output, "OK ddp-sums")) == list(range(np)), \
        output[-3000:]
