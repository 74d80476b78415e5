"""DeviceInfo: detection, described archs, and the use_device override."""

from __future__ import annotations

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.device import device_info, known_archs


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


def test_use_device_overrides_and_restores(gen):
    x, w = torch.randn(4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)
    with gg.use_device("gfx950") as info:
        problem = gg.explain(x, w, [1, 3]).problem
        assert problem.device == info and problem.placement == "cpu"
    assert gg.explain(x, w, [1, 3]).problem.device.arch == "cpu"
    with pytest.raises(gg.InvalidArgumentError), gg.use_device(3):
        pass


@pytest.mark.gpu
def test_cuda_device_is_detected():
    info = device_info(torch.device("cuda", 0))
    assert info.vendor in ("cuda", "rocm")
    assert info.multiprocessors == torch.cuda.get_device_properties(0).multi_processor_count
