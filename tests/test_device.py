"""DeviceInfo: detection, described archs, use_device (describes) and emulated (tests)."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.device import device_info, emulated, known_archs


def test_cpu_is_detected():
    info = device_info(torch.device("cpu"))
    assert (info.vendor, info.arch, info.detected) == ("cpu", "cpu", True)
    assert info.multiprocessors >= 1


@pytest.mark.parametrize(
    ("arch", "vendor", "scaled", "wgmma"),
    [
        ("sm_90", "cuda", False, True),
        ("sm_100", "cuda", True, False),
        ("gfx950", "rocm", True, False),
        ("gfx942", "rocm", False, False),
    ],
)
def test_described_archs(arch, vendor, scaled, wgmma):
    info = gg.DeviceInfo.for_arch(arch)
    assert (info.vendor, info.has("scaled_mma"), info.has("wgmma"), info.detected) == (vendor, scaled, wgmma, False)
    assert arch in str(info) and "described" in str(info)


def test_unknown_arch_lists_the_known_ones():
    with pytest.raises(gg.InvalidArgumentError, match=r"arch='sm_7'.*gfx950"):
        gg.DeviceInfo.for_arch("sm_7")
    assert "sm_90" in known_archs()


def test_use_device_describes_and_restores():
    described = {"groups": 2, "m": 64, "n": 64, "k": 64, "recipe": "mxfp8"}
    with gg.use_device("sm_100") as info:
        problem = gg.explain(**described).problem
        assert problem.device == info and problem.placement == "cuda"
        assert gg.list_backends()[0].reasons_here == gg.list_backends("sm_100")[0].reasons_here
    assert gg.explain(**described).problem.device.arch == "cpu"
    with pytest.raises(gg.InvalidArgumentError), gg.use_device(3):
        pass


def test_use_device_scopes_exited_out_of_order_leave_none_behind():
    """A generator's scope that closes after its caller's used to bring the caller's (already
    exited) chip back, so every later described problem of the thread was for it."""

    def arch() -> str:
        return gg.describe_problem(groups=2, m=8, n=8, k=8).device.arch

    here = arch()

    def steps():
        with gg.use_device("gfx950"):
            yield
            yield

    with gg.use_device("sm_100"):
        paused = steps()
        next(paused)  # its scope is entered inside ours and outlives it
    assert arch() == "gfx950"
    for _ in paused:
        pass
    assert arch() == here
    outer, inner = gg.use_device("sm_100"), gg.use_device("sm_100")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert arch() == "sm_100"
    inner.__exit__(None, None, None)
    assert arch() == here


def test_real_tensors_route_by_their_own_device_under_use_device(gen):
    """A description does not steer real calls: CPU tensors under use_device("sm_100")
    are judged, and run, as CPU tensors."""
    x, w, splits = torch.randn(64, 64, generator=gen), torch.randn(2, 64, 64, generator=gen), [30, 34]
    here = gg.explain(x, w, splits, recipe="mxfp8")
    with gg.use_device("sm_100"):
        described = gg.explain(groups=2, m=64, n=64, k=64, recipe="mxfp8", dtype="float32", splits=splits)
        real = gg.explain(x, w, splits, recipe="mxfp8")
        gg.grouped_gemm(x, w, splits, recipe="mxfp8")
    assert described.problem.device.arch == "sm_100"
    assert real.problem == here.problem and real.problem.device == device_info(torch.device("cpu"))
    assert real.selected == here.selected
    assert [(c.name, c.reasons) for c in real.candidates] == [(c.name, c.reasons) for c in here.candidates]
    assert gg.dispatch_stats()["selected"] == {here.selected: 1}


def test_emulated_routes_real_tensors_as_the_chip_and_restores(gen, register):
    x, w = torch.randn(4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    gg.grouped_gemm(x, w, [1, 3])  # a route cached for the CPU
    cpu = device_info(torch.device("cpu"))
    seen = []

    class Spy(gg.Backend):
        spec = gg.BackendSpec(
            name="spy", ops=frozenset({"fwd"}), recipes=frozenset({"fp32"}), vendors=frozenset({"cpu", "rocm"})
        )

        def run(self, problem, inputs):
            seen.append(problem.device.arch)
            return gg.grouped_gemm(inputs.a, inputs.b, inputs.m_splits, backend="reference")

    register(Spy())
    with gg.use_backends("spy"):
        with emulated("gfx950") as info:
            problem = gg.explain(x, w, [1, 3]).problem
            assert problem.device == info and problem.placement == "cpu"
            gg.grouped_gemm(x, w, [1, 3])
        gg.grouped_gemm(x, w, [1, 3])
    assert seen == ["gfx950", "cpu"]
    assert device_info(torch.device("cpu")) is cpu
    with pytest.raises(gg.InvalidArgumentError), emulated(3):
        pass


def test_emulated_scopes_exited_out_of_order_remove_only_their_own():
    """A scope exited before one opened inside it (an ``ExitStack`` misused, a generator
    closed late) leaves the inner chip in force, and the last exit restores the detected
    chip, not one whose scope is gone."""
    cpu = torch.device("cpu")
    detected = device_info(cpu)
    outer, inner = emulated("gfx950"), emulated("sm_100")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert device_info(cpu).arch == "sm_100"
    inner.__exit__(None, None, None)
    assert device_info(cpu) is detected
    with emulated("gfx950"), emulated("sm_90"):
        assert device_info(cpu).arch == "sm_90"
    assert device_info(cpu) is detected


@pytest.mark.gpu
def test_cuda_device_is_detected():
    info = device_info(torch.device("cuda", 0))
    assert info.vendor in ("cuda", "rocm")
    assert info.multiprocessors == torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("name", ["cpu", "meta", "cuda", "cuda:1"])
def test_device_kind_is_the_device_type_read_once(name):
    from grouped_gemm.torch_device import device_kind

    device = torch.device(name)
    assert device_kind(device) == device.type
    assert device_kind(torch.device(name)) is device_kind(device)  # the table's str, not a new one


def test_capturing_on_asks_torch_only_for_cuda_devices(monkeypatch):
    from grouped_gemm import torch_device

    asked = []
    monkeypatch.setattr(torch_device, "stream_capturing", lambda: asked.append(1) or True)
    assert not torch_device.capturing_on(torch.device("cpu"))
    assert not torch_device.capturing_on(torch.device("meta"))
    assert asked == []  # a CPU-only torch's capture query raises: never asked off CUDA
    assert torch_device.capturing_on(torch.device("cuda", 0))
    assert asked == [1]
