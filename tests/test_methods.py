"""The registry of methods (hvd_acp.methods): its entries, its checks, the
factories of hvd_acp's Horovod optimizers on a world of one, and every method
trained at 2 ranks under its launcher (tests/workers/methods_cases.py)."""
import json

import pytest
import torch
from torch import nn

import hvd_acp
from hvd_acp import methods
from hvd_acp.methods.counting import CountingCompression, counted_hook, fp16_hook_payload
from hvd_acp.methods import HOROVOD, KEYS, REGISTRY, TORCHRUN, Counters
from tests.hvdrun import horovodrun, rank_lines, torchrun


def test_every_method_is_declared_once_in_report_order():
    assert KEYS == ("ssgd", "ssgd-fp16", "ddp", "ddp-fp16", "powersgd", "powersgd-ddp",
                    "powersgd-ddp-batched", "acp", "acp-fp16", "acp-nooverlap", "acp-nofusion",
                    "acp-int8", "acp-ddp", "diloco", "demo", "tsr")
    for key, method in REGISTRY.items():
        assert method.key == key and method.launcher in (HOROVOD, TORCHRUN)
        assert method.title == f"{method.algorithm} ({method.implementation})"
        assert "\n" not in method.label and method.plot_label.replace("\n", " ") == method.label
    assert methods.label("powersgd") == "Power-SGD (hvd_acp)"
    assert REGISTRY["acp-ddp"].title == "ACP-SGD (DDP hvd_acp.ddp.acp_hook)"
    assert [m.key for m in REGISTRY.values() if m.launcher == HOROVOD] == [
        "ssgd", "ssgd-fp16", "powersgd", "acp", "acp-fp16", "acp-nooverlap", "acp-nofusion",
        "acp-int8", "diloco", "demo", "tsr"]
    # Only the baselines that average no gradient take settings of their own.
    assert {k: m.settings for k, m in REGISTRY.items() if m.settings} == {
        "diloco": ("inner_steps", "outer_lr", "outer_momentum", "nesterov"),
        "demo": ("top_k", "chunk_size", "momentum_decay"),
        "tsr": ("core_rank", "embedding_core_rank", "refresh_period", "embedding_refresh_period",
                "scale", "fp16_wire", "seed", "embedding_names")}
    assert [k for k, m in REGISTRY.items() if not m.averages_gradients] == [
        "diloco", "demo", "tsr"]
    assert len({m.color for m in REGISTRY.values()}) == len(REGISTRY)
    with pytest.raises(ValueError, match="method must be one of ssgd, ssgd-fp16, ddp, .*, got .topk."):
        methods.get("topk")


def test_variants_name_a_reference_of_their_algorithm_and_launcher():
    references = {}
    for key, method in REGISTRY.items():
        if method.variant_of is None:
            assert (method.algorithm, method.launcher) not in references, key
            references[(method.algorithm, method.launcher)] = key
    for key, method in REGISTRY.items():
        if method.variant_of is not None:
            assert references[(method.algorithm, method.launcher)] == method.variant_of, key
    assert {k for k, m in REGISTRY.items() if m.variant_of == "acp"} == {
        "acp-fp16", "acp-nooverlap", "acp-nofusion", "acp-int8"}


def test_the_planner_predicts_the_methods_the_registry_does_not_exempt():
    from hvd_acp.plan import METHODS, Settings, predict_methods
    assert METHODS == methods.predicted() == tuple(k for k in KEYS if k in METHODS)
    assert set(METHODS) == {"ssgd", "ssgd-fp16", "powersgd", "powersgd-ddp", "acp", "acp-ddp"}
    for key in set(KEYS) - set(METHODS):
        assert len(REGISTRY[key].not_predicted) > 20, key
    with pytest.raises(ValueError, match="acp-nooverlap is not predicted: an ablation"):
        predict_methods({}, Settings(np=2, network=None), ["acp", "acp-nooverlap"])


def test_build_refuses_settings_a_method_cannot_take():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps >= 2"):
        methods.get("powersgd-ddp").build(model, opt, warmup_steps=1)
    with pytest.raises(ValueError, match="DDP methods only"):
        methods.get("acp").build(model, opt, ddp_options={"init_sync": False})
    with pytest.raises(ValueError, match="overlap is set by the method"):
        methods.get("acp-nooverlap").build(model, opt, overlap=True)
    with pytest.raises(ValueError, match="fusion_threshold_bytes is set by the method"):
        methods.get("acp-nofusion").build(model, opt, fusion_threshold_bytes=1024)
    with pytest.raises(ValueError, match="compression is set by the method"):
        methods.get("ssgd-fp16").build(model, opt, compression=None)
    with pytest.raises(ValueError, match="compression is set by the method"):
        methods.get("acp-fp16").build(model, opt, compression=None)
    for key in ("ssgd-fp16", "ddp", "ddp-fp16"):
        with pytest.raises(ValueError, match="S-SGD averages every step exactly"):
            methods.get(key).build(model, opt, warmup_steps=3)


@pytest.mark.parametrize("key", ["acp", "powersgd", "acp-nooverlap", "acp-nofusion"])
def test_hvd_acp_factories_train_and_count(key):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    built = methods.get(key).build(model, opt, matrix_rank=2,
                                   communicator=hvd_acp.LocalCommunicator())
    try:
        assert built.model is model and built.state is None
        class_name = REGISTRY[key].implementation.split(",")[0].split(".")[-1]
        assert isinstance(built.optimizer, getattr(hvd_acp, class_name))
        batch = torch.randn(8, 32)
        for _ in range(2):
            built.optimizer.zero_grad()
            built.model(batch).square().mean().backward()
            built.optimizer.step()
        counters = built.counters()
        assert isinstance(counters, Counters)
        assert counters.compression_seconds > 0
        assert counters.bytes_sent == built.optimizer.comm_stats.bytes_sent
    finally:
        built.optimizer.close()


def test_the_8_bit_factors_run_at_twice_the_rank_given():
    """acp-int8 at twice the rank: the bytes of Power-SGD and of ACP-SGD's
    fp16 factors at the rank given, for the benchmark's equal-bytes row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    built = methods.get("acp-int8").build(model, opt, matrix_rank=0.1,
                                          communicator=hvd_acp.LocalCommunicator())
    try:
        assert built.optimizer.settings.int8_factors
        assert built.optimizer.settings.matrix_rank == 0.2
    finally:
        built.optimizer.close()
    for bad in (None, "auto", 0.5):
        with pytest.raises(ValueError, match="2 times the matrix_rank given"):
            methods.get("acp-int8").build(model, opt, matrix_rank=bad)


# ------------------------------------------------------- the ablations, one process
def _train_local(key, steps=5, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comm = hvd_acp.LocalCommunicator(0.5)
    built = methods.get(key).build(model, opt, matrix_rank=2, communicator=comm, **options)
    data = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            built.optimizer.zero_grad()
            built.model(torch.randn(8, 32, generator=data)).square().mean().backward()
            built.optimizer.step()
        return [p.detach().clone() for p in model.parameters()], built.counters(), comm
    finally:
        built.optimizer.close()


def test_ablations_change_the_schedule_not_the_maths_in_one_process():
    weights, counted, _ = _train_local("acp")
    for key in ("acp-nooverlap", "acp-nofusion"):
        other, other_counted, comm = _train_local(key)
        assert all(torch.equal(a, b) for a, b in zip(weights, other)), key
        assert other_counted.bytes_sent == counted.bytes_sent
    # One buffer per tensor: 6 tensors, 5 steps; acp fuses them into one per step.
    assert counted.allreduces == 5
    assert other_counted.allreduces == 30 and len(set(comm.launched)) == 12
    # The comparison can fail: other maths (no step-ahead) end elsewhere.
    other = _train_local("acp", step_ahead=0.0)[0]
    assert not all(torch.equal(a, b) for a, b in zip(weights, other))


@pytest.mark.parametrize("overlap", [True, False])
def test_without_overlap_nothing_is_compressed_or_sent_during_backward(overlap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = hvd_acp.LocalCommunicator()
    wrapped = hvd_acp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           matrix_rank=2, overlap=overlap, communicator=comm)
    try:
        model(torch.randn(4, 16)).sum().backward()
        assert bool(comm.launched) == overlap
        assert (wrapped.reducer.compression_seconds > 0) == overlap
        with pytest.raises(RuntimeError, match="zero_grad.*after loss.backward"):
            wrapped.zero_grad()
        wrapped.step()
        assert len(comm.launched) == 1 and wrapped.step_count == 1
        assert wrapped.reducer.compression_seconds > 0
        wrapped.zero_grad()
    finally:
        wrapped.close()


@pytest.mark.parametrize("value", [0, 1, "no", None])
def test_overlap_must_be_a_bool(value):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=f"overlap must be a bool, got {value!r}"):
        hvd_acp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     overlap=value, communicator=hvd_acp.LocalCommunicator())


# ------------------------------------------------------------ counting, one process
class _Half:
    """hvd.Compression.fp16's contract without Horovod."""

    @staticmethod
    def compress(tensor):
        return tensor.half(), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def test_counting_compression_counts_what_leaves_the_compression():
    counting = CountingCompression(_Half, timed=True)
    grads = [torch.randn(3, 5), torch.randn(7)]
    for grad in grads:
        sent, ctx = counting.compress(grad)
        assert sent.dtype == torch.float16
        assert counting.decompress(sent, ctx).dtype == torch.float32
    assert counting.counters() == Counters(2 * 22, 2, counting.compression_seconds)
    assert counting.compression_seconds > 0
    untimed = CountingCompression(_Half, timed=False)
    untimed.compress(grads[0])
    assert untimed.counters() == Counters(30, 1, 0.0)


def test_counted_hook_counts_each_call():
    class Bucket:
        def __init__(self, n):
            self._buffer = torch.zeros(n)

        def buffer(self):
            return self._buffer

    seen = []
    hook, counters = counted_hook(lambda state, bucket: seen.append(state) or "future",
                                  fp16_hook_payload)
    assert hook("s", Bucket(10)) == "future" and hook("s", Bucket(6)) == "future"
    assert seen == ["s", "s"]
    assert counters()[:2] == (32, 2)


# ------------------------------------------------------------------ 2 ranks, real
def _results(output: str) -> dict:
    found = {}
    for line in rank_lines(output, "RESULT"):
        entry = json.loads(line)
        found.setdefault(entry["key"], []).append(entry)
    return found


def _steady(values, skip=0):
    """The per-step values after ``skip`` steps, which must all be equal."""
    assert len(set(values[skip:])) == 1, values
    return values[skip]


@pytest.fixture(scope="module")
def horovod_runs():
    keys = ("ssgd", "ssgd-fp16", "acp", "acp-fp16", "acp-nooverlap", "acp-nofusion")
    out = horovodrun("methods_cases.py", "horovod", *keys, timeout=240).stdout
    assert sorted(rank_lines(out, "OK horovod")) == ["0", "1"], out[-4000:]
    return {key: entries[0] for key, entries in _results(out).items()}


@pytest.fixture(scope="module")
def torchrun_runs():
    # powersgd-ddp twice: a second probe in the same process counts only its own hook.
    keys = ("ddp", "ddp-fp16", "powersgd-ddp", "powersgd-ddp-batched", "powersgd-ddp")
    out = torchrun("methods_cases.py", "torchrun", *keys, timeout=240)
    assert sorted(rank_lines(out, "OK torchrun")) == ["0", "1"], out[-4000:]
    return _results(out)


def test_horovod_methods_at_two_ranks_count_their_bytes(horovod_runs):
    """Replicas bit-identical after every method (checked in the worker);
    S-SGD sends every gradient, fp16 half of it; the ablations send what
    ACP-SGD sends and end bit for bit where it ends (at 2 ranks an
    all-reduce's sum has one order, whatever the buffers)."""
    ssgd, fp16, acp = horovod_runs["ssgd"], horovod_runs["ssgd-fp16"], horovod_runs["acp"]
    grads, tensors = ssgd["gradient_bytes"], ssgd["tensors"]
    assert _steady(ssgd["bytes_per_step"]) == grads
    assert _steady(fp16["bytes_per_step"]) * 2 == grads
    assert _steady(ssgd["allreduces_per_step"]) == _steady(fp16["allreduces_per_step"]) == tensors
    assert ssgd["compression_seconds"] == 0.0 < fp16["compression_seconds"]
    assert fp16["digest"] != ssgd["digest"]
    assert 0 < max(acp["bytes_per_step"]) < grads / 4
    for key in ("acp-nooverlap", "acp-nofusion"):
        run = horovod_runs[key]
        assert run["bytes_per_step"] == acp["bytes_per_step"], key
        assert run["digest"] == acp["digest"], key
        assert run["compression_seconds"] > 0
    assert horovod_runs["acp-nooverlap"]["allreduces_per_step"] == acp["allreduces_per_step"]
    assert _steady(horovod_runs["acp-nofusion"]["allreduces_per_step"]) == tensors
    assert _steady(acp["allreduces_per_step"]) < tensors
    # fp16 on the wire: the same factors, half the bytes, other bits.
    half = horovod_runs["acp-fp16"]
    assert [2 * b for b in half["bytes_per_step"]] == acp["bytes_per_step"]
    assert half["allreduces_per_step"] == acp["allreduces_per_step"]
    assert half["digest"] != acp["digest"]


def test_ddp_methods_at_two_ranks_count_their_bytes(torchrun_runs, horovod_runs):
    ddp, fp16 = torchrun_runs["ddp"][0], torchrun_runs["ddp-fp16"][0]
    grads = ddp["gradient_bytes"]
    assert _steady(ddp["bytes_per_step"]) == grads
    assert _steady(fp16["bytes_per_step"]) * 2 == grads
    # DDP's first step fills one bucket, its rebuilt buckets follow (the fp16
    # hook, counted per call, sees the same).
    assert ddp["allreduces_per_step"] == fp16["allreduces_per_step"]
    assert ddp["allreduces_per_step"][0] == 1 < _steady(ddp["allreduces_per_step"], skip=1)
    # Plain DDP is S-SGD: at 2 ranks the same bits as Horovod's.
    assert ddp["digest"] == horovod_runs["ssgd"]["digest"]
    plain, batched, again = (torchrun_runs["powersgd-ddp"][0],
                             torchrun_runs["powersgd-ddp-batched"][0],
                             torchrun_runs["powersgd-ddp"][1])
    for run in (plain, batched, again):
        # Two exact steps (the whole gradient), then P and Q and the rest.
        assert run["bytes_per_step"][:2] == [grads, grads]
        assert _steady(run["bytes_per_step"], skip=2) == run["analytic_powersgd_bytes"]
        assert run["compression_seconds"] > 0
    assert batched["bytes_per_step"] == plain["bytes_per_step"] == again["bytes_per_step"]
    assert again["digest"] == plain["digest"]
