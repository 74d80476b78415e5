"""Group ends for the kernels (``GroupedInputs.offsets``): values and the work they cost."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

import grouped_gemm as gg
from grouped_gemm import group_ends as group_ends_module
from grouped_gemm import group_offsets, updates, validation
from grouped_gemm import inputs as inputs_module
from grouped_gemm.testing import poison, ref_dgrad, ref_fwd, ref_wgrad, rel_error

SPLIT_CASES = [[5], [0, 0, 7], [3, 0, 9, 0, 1], [0], [16, 16, 16, 16]]


class _OpLog(TorchDispatchMode):
    """Records every aten op run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


real_launch = group_ends_module._launch


def _reference(splits: list[int]) -> list[int]:
    return list(itertools.accumulate(splits))


@pytest.mark.parametrize("splits", SPLIT_CASES)
@pytest.mark.parametrize("form", ["host", "int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offsets_equal_reference(splits, form, dtype):
    given = splits if form == "host" else torch.tensor(splits, dtype=getattr(torch, form))
    ends = gg.GroupedInputs(None, None, given).offsets(torch.device("cpu"), dtype)
    assert ends.dtype == dtype and ends.device.type == "cpu"
    assert ends.tolist() == _reference(splits)


@pytest.mark.parametrize("split_dtype", [torch.int32, torch.int64])
def test_device_splits_cost_one_launch_and_are_cached(split_dtype, monkeypatch):
    """One scan kernel straight into int32 (no widening, no separate conversion), once per
    call; CPU tensors run it in Triton's interpreter, else they take one cumsum."""
    launches = []
    monkeypatch.setattr(group_ends_module, "_launch", lambda *a: launches.append(a) or real_launch(*a))
    inputs = gg.GroupedInputs(None, None, torch.tensor([4, 0, 2**20], dtype=split_dtype))
    with _OpLog() as log:
        first = inputs.offsets(torch.device("cpu"))
        again = inputs.offsets(torch.device("cpu"))
    if isinstance(group_ends_module.group_ends_kernel, InterpretedFunction):
        assert len(launches) == 1 and "cumsum" not in log.ops
    else:
        assert not launches and log.ops == ["cumsum"]
    assert again is first and first.tolist() == [4, 4, 4 + 2**20] and first.dtype == torch.int32


needs_interpreter = pytest.mark.skipif(
    not isinstance(group_ends_module.group_ends_kernel, InterpretedFunction),
    reason="CPU tensors run the scan kernel only in Triton's interpreter",
)


@needs_interpreter
@pytest.mark.parametrize("groups", [1, 3, 16, 17, 257])
@pytest.mark.parametrize("split_dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_group_ends_kernel_equals_cumsum(groups, split_dtype, dtype):
    high = 100 if split_dtype in (torch.uint8, torch.int8) else 5000
    sizes = torch.randint(0, high, (groups,), dtype=split_dtype)
    sizes[torch.randint(0, groups, (groups // 3,))] = 0  # empty groups
    ends = group_ends_module.group_ends(sizes, dtype)
    assert ends.dtype == dtype and torch.equal(ends, torch.cumsum(sizes, 0, dtype=dtype))
    copy, ends32 = group_ends_module.copy_and_ends(sizes)
    assert torch.equal(copy, sizes) and copy.data_ptr() != sizes.data_ptr() and copy.dtype == split_dtype
    assert torch.equal(ends32, torch.cumsum(sizes, 0, dtype=torch.int32))


@needs_interpreter
def test_group_ends_kernel_wraps_like_cumsum():
    """Totals past int32 wrap exactly as ``torch.cumsum(..., dtype=torch.int32)`` does (the
    call's checks refuse such splits before any kernel reads them)."""
    sizes = torch.tensor([2**31 - 5, 7, 2**40, 3], dtype=torch.int64)
    assert torch.equal(group_ends_module.group_ends(sizes), torch.cumsum(sizes, 0, dtype=torch.int32))


@pytest.mark.parametrize("groups", [1, 3, 17, 257])
@pytest.mark.parametrize("split_dtype", [torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("align", [32, 128])
def test_padded_row_table(groups, split_dtype, align):
    """Tight starts, padded starts and padded sizes, against the sums worked out in Python
    (the kernel in the interpreter, torch ops otherwise)."""
    sizes = torch.randint(0, 100, (groups,), dtype=split_dtype)
    sizes[torch.randint(0, groups, (groups // 3,))] = 0  # empty groups
    padded = [-(-s // align) * align for s in sizes.tolist()]
    starts, padded_starts, padded_sizes = group_ends_module.padded_row_table(sizes, align)
    assert starts.tolist() == [0, *itertools.accumulate(sizes.tolist())]
    assert padded_starts.tolist() == [0, *itertools.accumulate(padded)]
    assert padded_sizes.tolist() == padded
    assert {starts.dtype, padded_starts.dtype, padded_sizes.dtype} == {torch.int32}


def test_group_ends_falls_back_to_cumsum(monkeypatch):
    """Past MAX_GROUPS, with no groups, or strided sizes: torch.cumsum, no launch."""
    monkeypatch.setattr(group_ends_module, "_launch", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(group_ends_module, "MAX_GROUPS", 8)
    for sizes in (torch.arange(9), torch.zeros(0, dtype=torch.int64), torch.arange(12)[::2]):
        assert torch.equal(group_ends_module.group_ends(sizes), torch.cumsum(sizes, 0, dtype=torch.int32))
        copy, ends = group_ends_module.copy_and_ends(sizes)
        assert torch.equal(copy, sizes) and torch.equal(ends, torch.cumsum(sizes, 0, dtype=torch.int32))


def test_host_splits_build_ends_in_python():
    """Host splits: the ends are summed on the host and become one tensor (no device op)."""
    inputs = gg.GroupedInputs(None, None, (7, 0, 3))
    with _OpLog() as log:
        ends = inputs.offsets(torch.device("cpu"))
    assert "cumsum" not in log.ops and ends.tolist() == [7, 7, 10] and ends.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["host", "int32", "int64"])
def test_offsets_on_gpu_without_sync(form):
    splits = [3, 0, 9, 0, 1]
    device = torch.device("cuda")
    given = splits if form == "host" else torch.tensor(splits, dtype=getattr(torch, form), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ends = gg.GroupedInputs(None, None, given).offsets(device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ends.dtype == torch.int32 and ends.device.type == "cuda"
    assert ends.cpu().tolist() == _reference(splits)


# ---------------------------------------------------------------- gg.offsets


@pytest.mark.parametrize("splits", SPLIT_CASES)
@pytest.mark.parametrize("form", ["list", "tuple", "int32", "int64"])
def test_group_offsets_hold_a_private_copy(splits, form):
    given = {"list": list, "tuple": tuple}[form](splits) if form in ("list", "tuple") else None
    if given is None:
        given = torch.tensor(splits, dtype=getattr(torch, form))
    offs = gg.offsets(given)
    assert offs.splits.tolist() == splits and offs.ends.tolist() == _reference(splits)
    assert offs.ends.dtype == torch.int32 and len(offs) == len(splits) and offs.device.type == "cpu"
    assert offs.total == sum(splits)
    if isinstance(given, torch.Tensor):
        given.fill_(99)
    elif isinstance(given, list):
        given[0] = 99
    assert offs.splits.tolist() == splits, "editing the caller's splits must not reach the offsets"
    assert gg.offsets(offs) is offs


@pytest.fixture(params=["none declared", "another declared"])
def declared_writes(request, monkeypatch):
    """No ``gg.mark_updated`` in the process (``GroupOffsets.written`` compares torch's
    counts alone) or one on an unrelated tensor (it compares whole write stamps)."""
    monkeypatch.setattr(updates, "DECLARED", {})
    monkeypatch.setattr(group_offsets, "DECLARED", updates.DECLARED)
    other = torch.zeros(2)
    if request.param == "another declared":
        gg.mark_updated(other)
    yield request.param
    del other


@pytest.mark.parametrize("tensor", ["splits", "ends"])
@pytest.mark.parametrize("host", [True, False])
def test_offsets_written_in_place_are_refused(tensor, host, gen, declared_writes):
    """New sizes written into a GroupOffsets (same total, so nothing else would notice)
    left its ends as they were: backends that read the ends routed rows by the old sizes,
    the others by the new ones."""
    assert bool(updates.DECLARED) == (declared_writes == "another declared")
    x, w = torch.randn(8, 4, generator=gen), torch.randn(3, 4, 4, generator=gen)
    offs = gg.offsets([3, 0, 5] if host else torch.tensor([3, 0, 5]))
    assert torch.allclose(gg.grouped_gemm(x, w, offs), gg.grouped_gemm(x, w, [3, 0, 5]))
    getattr(offs, tensor).copy_(torch.tensor([8, 0, 0] if tensor == "splits" else [8, 8, 8]))
    with pytest.raises(gg.SplitsError, match="written in place"):
        gg.grouped_gemm(x, w, offs)
    assert torch.allclose(gg.grouped_gemm(x, w, gg.offsets([8, 0, 0])), x @ w[0].T)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    ("parts", "argument"),
    [
        ((_i32([3, 0, 5]), _i32([1, 2, 8]), 8), "ends"),  # same total, other group ends
        ((_i32([3, 0, 5]), _i32([3, 3, 8]), 9), "total"),
        ((_i32([3, 0, 5]), _i32([3, 3, 8]), True), "total"),
        ((_i32([3, 0, 5]), torch.tensor([3, 3, 8]), 8), "ends"),  # int64: a backend's RuntimeError
        ((_i32([3, 0, 5]), _i32([3]), 8), "ends"),
        ((_i32([3, 0, 5]), [3, 3, 8], 8), "ends"),  # a list: an AttributeError at the call
        (([3, 0, 5], _i32([3, 3, 8]), 8), "splits"),
        ((torch.tensor([3.0, 0.0, 5.0]), _i32([3, 3, 8]), 8), "splits"),
    ],
)
def test_a_group_offsets_built_by_hand_must_agree_with_itself(parts, argument, gen):
    """Backends take a GroupOffsets' ends as given: built by hand with ends that are not
    the running sum of its splits, torch_grouped_mm routed rows by the ends and reference
    by the splits, and neither said a word."""
    with pytest.raises(gg.SplitsError, match=rf"^{argument}="):
        gg.GroupOffsets(*parts)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(3, 8, 16, generator=gen)
    offs = gg.GroupOffsets(_i32([3, 0, 5]), _i32([3, 3, 8]), 8)  # consistent parts are accepted
    for backend in ("torch_grouped_mm", "reference"):
        assert rel_error(gg.grouped_gemm(x, w, offs, backend=backend), ref_fwd(x, w, [3, 0, 5])) < 1e-6


def test_offsets_built_under_inference_mode(gen, declared_writes):
    """Inference tensors keep no version counter (reading it raises): offsets made in
    ``torch.inference_mode`` work, and a write declared by ``gg.mark_updated`` is refused."""
    x, w = torch.randn(8, 4, generator=gen), torch.randn(3, 4, 4, generator=gen)
    with torch.inference_mode():
        offs = gg.offsets([3, 0, 5])
        assert torch.allclose(gg.grouped_gemm(x, w, offs), gg.grouped_gemm(x, w, [3, 0, 5]))
        offs.splits.copy_(torch.tensor([8, 0, 0]))
        gg.mark_updated(offs.splits)
        with pytest.raises(gg.SplitsError, match="written in place"):
            gg.grouped_gemm(x, w, offs)


@pytest.mark.parametrize(
    ("bad", "error", "needle"),
    [
        ([3, -1], gg.SplitsError, "m_splits[1]=-1"),
        ([3, True], gg.SplitsError, "bool"),
        ([3, 2.0], gg.SplitsError, "float"),
        ([], gg.SplitsError, "at least one group"),
        ([2**31, 0], gg.SplitsError, "int32 ends"),
        (torch.tensor([1.0, 2.0]), gg.SplitsError, "1-D integer tensor"),
        (torch.tensor([[1, 2]]), gg.SplitsError, "1-D integer tensor"),
        (torch.tensor([1, 2], device="meta"), gg.SplitsError, "not meta"),
        ("8,8", gg.SplitsError, "list/tuple"),
    ],
)
def test_offsets_refuse_bad_splits_by_name(bad, error, needle):
    with pytest.raises(error, match="m_splits") as info:
        gg.offsets(bad)
    assert needle in str(info.value)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_tensor_is_named_not_crashed_on():
    """Every error naming a nested tensor crashed while writing its message (``.shape``
    raises on one: torch's "NestedTensorImpl doesn't support sizes"), here and in
    ``gg.grouped_gemm``."""
    nested = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(gg.SplitsError, match=r"^m_splits=Tensor\(nested, dtype=torch.int64, device=cpu\) is invalid"):
        gg.offsets(nested)
    x = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
    with pytest.raises(gg.InvalidArgumentError, match=r"^x=Tensor\(nested, dtype=torch.float32.*not a nested tensor"):
        gg.grouped_gemm(x, torch.randn(2, 4, 8), [2, 3])


@pytest.mark.parametrize("splits", [[1, 2], torch.tensor([1, 2])])
def test_offsets_on_a_gpu_that_is_not_there_is_named(splits):
    """``device='cuda'`` without a GPU raised torch's "pin_memory=True requires a CUDA or
    other accelerator backend"; an index past the visible GPUs, "invalid device ordinal"."""
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(gg.InvalidArgumentError, match=rf"^device='{missing}' is invalid: a GPU this process sees"):
        gg.offsets(splits, device=missing)


def test_offsets_of_offsets_on_another_device_is_refused():
    with pytest.raises(gg.DeviceMismatchError, match="device"):
        gg.offsets(gg.offsets([1, 2]), device="meta")


def test_validation_hands_out_the_ends_without_a_kernel():
    offs = gg.offsets([5, 0, 3])
    x, w = torch.randn(8, 16), torch.randn(3, 4, 16)
    for op, a, b in (("fwd", x, w), ("dgrad", torch.randn(8, 4), w)):
        inputs = validation.fwd_or_dgrad(op, a, b, offs, None, None, None).inputs
        with _OpLog() as log:
            ends = inputs.offsets(torch.device("cpu"))
        assert ends is offs.ends and log.ops == []
        assert inputs.m_splits == (5, 0, 3), "on the CPU the splits are read back as host splits"
    inputs = validation.wgrad(torch.randn(8, 4), x, offs, None, None, None, False).inputs
    assert inputs.offsets(torch.device("cpu")) is offs.ends


@pytest.mark.parametrize(("splits", "rows", "needle"), [([5, 0, 3], 9, "sum to 8"), ([4, 4], 8, "expected 3")])
def test_offsets_that_do_not_fit_the_call_are_refused(splits, rows, needle):
    x, w = torch.randn(rows, 16), torch.randn(3, 4, 16)
    with pytest.raises(gg.SplitsError, match="m_splits") as info:
        gg.grouped_gemm(x, w, gg.offsets(splits))
    assert needle in str(info.value)
    with pytest.raises(gg.SplitsError, match="m_splits"):
        gg.grouped_gemm_wgrad(torch.randn(rows, 4), x, gg.offsets([*splits, 1]) if rows == 8 else gg.offsets(splits))


def _eligible(op: str, a: torch.Tensor, b: torch.Tensor, m_splits: object) -> list[str]:
    return [c.name for c in gg.explain(a, b, m_splits, op=op).candidates if c.eligible]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_backend_takes_offsets(gen, dtype):
    """fwd, dgrad and wgrad with gg.offsets equal the float64 reference on every eligible
    CPU backend, and the same backend's result for the plain list, bit for bit."""
    splits = [9, 0, 14, 0, 1]
    m, n, k = sum(splits), 16, 32
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(5, n, k, generator=gen) / k**0.5).to(dtype)
    dy = torch.randn(m, n, generator=gen).to(dtype)
    offs = gg.offsets(splits)
    cases = {
        "fwd": (x, w, ref_fwd(x, w, splits), (m, n)),
        "dgrad": (dy, w, ref_dgrad(dy, w, splits), (m, k)),
        "wgrad": (dy, x, ref_wgrad(dy, x, splits), (5, n, k)),
    }
    seen = set()
    for op, (a, b, ref, shape) in cases.items():
        names = _eligible(op, a, b, offs)
        assert names == _eligible(op, a, b, splits) and "reference" in names
        call = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
        for name in names:
            out = poison(torch.empty(shape, dtype=dtype))
            got = call(a, b, offs, backend=name, out=out)
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(got, call(a, b, splits, backend=name)), (op, name)
            assert rel_error(got.double(), ref) < (1e-5 if dtype == torch.float32 else 1e-2), (op, name)
            seen.add(name)
    assert {"reference", "torch_grouped_mm"} <= seen


def test_grouped_linear_and_gmm_take_offsets(gen):
    """Forward and backward (dgrad, wgrad, bias) through autograd, and ops.gmm, equal the
    plain-list calls; the offsets object is reused by all of them."""
    splits = [3, 0, 6, 7]
    m, n, k = sum(splits), 16, 32
    layer = gg.GroupedLinear(4, k, n, bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(4, n, generator=gen))
    x = torch.randn(m, k, generator=gen)
    offs = gg.offsets(splits)
    results = []
    for given in (splits, offs):
        xg = x.clone().requires_grad_(True)
        layer.zero_grad()
        y = layer(xg, given)
        y.square().sum().backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        results.append((y.detach(), xg.grad, grads))
    (y0, dx0, g0), (y1, dx1, g1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    w = torch.randn(4, n, k, generator=gen)
    functional = gg.grouped_linear(x, w, offs)
    assert torch.equal(functional, gg.grouped_linear(x, w, splits))
    gmm = gg.ops.gmm(x, w, offs, trans_b=True)
    assert rel_error(gmm.double(), ref_fwd(x, w, splits)) < 1e-5


def test_grouped_linear_compiles_with_offsets(gen):
    """Under torch.compile the custom ops get the offsets' splits tensor (fullgraph)."""
    layer = gg.GroupedLinear(3, 32, 16, bias=True, dtype=torch.float32)
    x = torch.randn(8, 32, generator=gen)
    compiled = torch.compile(lambda x, s: layer(x, s), fullgraph=True, backend="eager")
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = compiled(xc, gg.offsets([3, 0, 5]))
    y.square().sum().backward()
    expected = layer(xe, [3, 0, 5])
    expected.square().sum().backward()
    assert torch.equal(y, expected) and torch.equal(xc.grad, xe.grad)


def test_quantize_mx_rows_takes_offsets(gen):
    t = torch.randn(96, 64, generator=gen)
    plain = gg.quantize_mx_rows(t, [32, 0, 64], "e4m3")
    given = gg.quantize_mx_rows(t, gg.offsets([32, 0, 64]), "e4m3")
    assert torch.equal(given.offsets, plain.offsets) and torch.equal(given.padded_offsets, plain.padded_offsets)
    assert torch.equal(given.tensor.data.view(torch.uint8), plain.tensor.data.view(torch.uint8))
    assert torch.equal(given.tensor.scale.view(torch.uint8), plain.tensor.scale.view(torch.uint8))


@pytest.mark.gpu
def test_offsets_reused_on_gpu_without_sync():
    """Device splits: gg.offsets and three GEMMs reusing it run with no host sync."""
    device = torch.device("cuda")
    splits = [8, 0, 24, 32]
    m, n, k = sum(splits), 64, 128
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, n, k, device=device, dtype=torch.bfloat16) / k**0.5
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    dev = torch.tensor(splits, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        offs = gg.offsets(dev)
        y = gg.grouped_gemm(x, w, offs)
        dx = gg.grouped_gemm_dgrad(dy, w, offs)
        dw = gg.grouped_gemm_wgrad(dy, x, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert offs.total is None and offs.ends.device.type == "cuda"
    assert torch.equal(y, gg.grouped_gemm(x, w, dev))
    assert torch.equal(dx, gg.grouped_gemm_dgrad(dy, w, dev))
    assert torch.equal(dw, gg.grouped_gemm_wgrad(dy, x, dev))
    host = gg.offsets(splits, device=device)
    assert host.total == m and host.ends.cpu().tolist() == _reference(splits)


@pytest.mark.gpu
def test_host_splits_reused_on_a_stream_are_sent_once(monkeypatch):
    """The same host splits on the same stream: one pinned copy, then the cached ends; a
    new stream or new splits send their own, a graph capture too; results stay right."""
    device = torch.device("cuda")
    splits = [8, 0, 24, 32]
    m, n, k = sum(splits), 64, 128
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, n, k, device=device, dtype=torch.bfloat16) / k**0.5
    inputs_module._RECENT_ENDS.clear()
    first = gg.grouped_gemm(x, w, splits)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        again = gg.grouped_gemm(x, w, list(splits))
        torch.cuda.synchronize()
    assert not [e for e in prof.events() if "Memcpy" in e.name], "the cached ends must not be copied again"
    assert torch.equal(first, again) and len(inputs_module._RECENT_ENDS) == 1
    assert rel_error(again, ref_fwd(x, w, splits)) < 1e-2
    other = [32, 24, 0, 8]
    assert rel_error(gg.grouped_gemm(x, w, other), ref_fwd(x, w, other)) < 1e-2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = gg.grouped_gemm(x, w, splits)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first) and len(inputs_module._RECENT_ENDS) == 3
    # Host splits are refused under capture by every built-in backend (the graph would
    # keep them); a plugin that takes them still gets fresh ends, never cached ones.
    monkeypatch.setattr(inputs_module, "stream_capturing", lambda: True)
    fresh = inputs_module.host_ends(tuple(splits), device)
    assert len(inputs_module._RECENT_ENDS) == 3, "nothing is cached under capture"
    assert all(fresh is not ends for ends in inputs_module._RECENT_ENDS.values())
    assert fresh.tolist() == _reference(splits)


def test_host_sizes_are_the_splits_on_the_device():
    """``host_sizes`` sends the sizes themselves (the Triton MX kernels sum them), ``host_ends``
    their sums, from one tuple; the Triton backends' ``device_splits`` takes host splits so."""
    from grouped_gemm.backends.triton_mx import launch

    splits, cpu = (3, 0, 5), torch.device("cpu")
    sizes = inputs_module.host_sizes(splits, cpu)
    assert sizes.dtype == torch.int32 and sizes.tolist() == [3, 0, 5]
    assert inputs_module.host_ends(splits, cpu).tolist() == [3, 3, 8]
    assert launch.device_splits(splits, cpu).tolist() == [3, 0, 5]


@pytest.mark.gpu
def test_host_sizes_and_ends_of_one_split_are_cached_apart():
    """One step's host splits on a stream: ``torch_grouped_mm`` sends their ends, a Triton MX
    call their sizes; each once, under keys of their own, and every result stays right."""
    device = torch.device("cuda")
    splits = [8, 0, 24, 32]
    m, n, k = sum(splits), 64, 128
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(4, n, k, device=device, dtype=torch.bfloat16) / k**0.5
    w_mx = gg.quantize_mx_weight(w, "e2m1", op="fwd")
    inputs_module._RECENT_ENDS.clear()
    plain = gg.grouped_gemm(x, w, splits)
    first = gg.grouped_gemm(x, w_mx, splits, recipe="a16w4")
    assert sorted(key[1] for key in inputs_module._RECENT_ENDS) == [False, True]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        again = gg.grouped_gemm(x, w_mx, list(splits), recipe="a16w4")
        torch.cuda.synchronize()
    assert not [e for e in prof.events() if "Memcpy" in e.name], "the cached sizes must not be copied again"
    assert torch.equal(first, again) and len(inputs_module._RECENT_ENDS) == 2
    assert rel_error(plain, ref_fwd(x, w, splits)) < 1e-2
    assert rel_error(again, ref_fwd(x, w_mx.dequantize(torch.float32), splits)) < 1e-2
