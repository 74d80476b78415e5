"""Adversarial cases from the second pass: the training path (``main_grad`` buffers of
fused wgrad accumulation), the MX quantizers, backend registration and scopes, the CLI.
Each failed before its fix; CPU only, small shapes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import tuning_store

G, K, N = 2, 32, 8
SPLITS = [3, 5]

# ---- main_grad buffers of fuse_wgrad_accumulation --------------------------------------------

BAD_MAIN_GRADS: dict[str, Callable[[torch.nn.Parameter], torch.Tensor]] = {
    "int64": lambda w: torch.zeros(w.shape, dtype=torch.int64),
    "float64": lambda w: torch.zeros(w.shape, dtype=torch.float64),
    "transposed": lambda w: torch.zeros(G, K, N).transpose(1, 2),
    "expanded": lambda w: torch.zeros(1, N, K).expand(G, N, K),
    "the_weight_itself": lambda w: w.data,
    "a_view_of_the_weight": lambda w: w.data[:].view(w.shape),
    "an_inference_tensor": lambda w: _inference_zeros(w.shape),
}


def _inference_zeros(shape: torch.Size) -> torch.Tensor:
    """Made under inference mode: backward (outside it) cannot add into it in place."""
    with torch.inference_mode():
        return torch.zeros(shape)


@pytest.mark.parametrize("bad", list(BAD_MAIN_GRADS))
def test_a_bad_main_grad_is_named_at_forward(bad, gen):
    """A main_grad of a dtype wgrad cannot write, not contiguous, or aliasing the weight
    (wgrad would add into the weight) used to pass the forward and fail in backward as
    ``out=... is invalid`` (an argument the caller never passed), or for the alias, run
    and corrupt the weight silently. Now the forward refuses it by its name."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = BAD_MAIN_GRADS[bad](layer.weight)
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    with pytest.raises(gg.GroupedGemmError, match=r"^weight\.main_grad="):
        layer(x, SPLITS)


# ---- MXTensor parts and the weight quantizer ------------------------------------------------


def _parts(**change: object) -> dict[str, object]:
    parts: dict[str, object] = {
        "data": torch.zeros(4, 64, dtype=torch.float8_e4m3fn),
        "scale": torch.full((4, 2), 127, dtype=torch.uint8),
        "fmt": "e4m3",
        "axis": 1,
        "shape": (4, 64),
    }
    return {**parts, **change}


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"shape": 64}, "shape"),
        ({"shape": None}, "shape"),
        ({"shape": ("4", 64)}, "shape"),
        ({"shape": (4.7, 64)}, "shape"),
        ({"block_size": 32.0}, "block_size"),
        ({"block_size": "32"}, "block_size"),
    ],
)
def test_mxtensor_parts_of_the_wrong_type_are_named(change, name):
    """``shape`` went through ``tuple(int(s) for s in shape)``: an int or None raised a bare
    TypeError, ``(4.7, 64)`` was truncated to ``(4, 64)`` silently; ``block_size=32.0``
    passed ``in BLOCK_SIZES`` and crashed in ``dequantize``'s reshape."""
    with pytest.raises(gg.GroupedGemmError, match=rf"^{name}="):
        gg.MXTensor(**_parts(**change)).dequantize()


def test_mxtensor_accepts_a_torch_size_and_numpy_ints():
    np = pytest.importorskip("numpy")
    t = gg.MXTensor(**_parts(shape=torch.Size([4, np.int64(64)]), block_size=np.int32(32)))
    assert t.shape == (4, 64) and type(t.block_size) is int
    assert torch.equal(t.dequantize(), torch.zeros(4, 64))


@pytest.mark.parametrize(
    ("w", "op", "name"),
    [
        (lambda: torch.randn(2, 8, 64), ["fwd"], "op"),
        (lambda: [torch.randn(8, 64), torch.randn(8, 32)], "fwd", r"w\[1\]"),
        (lambda: [torch.randn(8, 64), torch.randn(8, 64, device="meta")], "fwd", r"w\[1\]"),
    ],
)
def test_quantize_mx_weight_names_what_is_wrong(w, op, name):
    """An unhashable ``op`` raised ``TypeError: unhashable type``; a weight list of mixed
    shapes or devices failed inside ``torch.stack`` without naming the weight."""
    with pytest.raises(gg.GroupedGemmError, match=rf"^{name}="):
        gg.quantize_mx_weight(w(), "e4m3", op=op)


# ---- registry and orders -----------------------------------------------------------------


def test_unregister_an_unhashable_name_is_named():
    """``unregister_backend(["x"])`` raised ``TypeError: unhashable type`` from a dict lookup."""
    with pytest.raises(gg.UnknownBackendError, match=r"^backend=\['reference'\]"):
        gg.unregister_backend(["reference"])
    assert "reference" in {b.name for b in gg.list_backends()}


@pytest.mark.parametrize("names", [3, {"reference"}, None])
def test_an_order_mapping_needs_names_in_order(names):
    """A mapping's value went through ``list(names)``: ``{"fp32": 3}`` raised a bare
    TypeError, and a set was accepted in an arbitrary order (a top-level set is refused)."""
    with pytest.raises(gg.ConfigError, match=r"^order="), gg.use_backends({"fp32": names}):
        pass


# ---- the autotune store -------------------------------------------------------------------


def _tuning() -> tuning_store.Tuning:
    timing = tuning_store.Timing("a", None, 1.0, 3)
    return tuning_store.Tuning("k", "p", 1, "a", None, "a", (timing,), 1.0, "now")


def test_a_store_file_that_is_not_utf8_is_ignored_and_rewritten(tmp_path):
    """``read_text`` raises UnicodeDecodeError (a ValueError, not an OSError) on a file of
    binary junk: it escaped ``load``, so every autotuned call failed, and ``save``."""
    path = tmp_path / "autotune" / "x.json"
    path.parent.mkdir()
    path.write_bytes(b"\xff\xfe\x00junk")
    with pytest.warns(tuning_store.AutotuneCacheWarning, match="corrupt"):
        assert tuning_store.load(path, {"device": "d"}) == {}
    assert tuning_store.save(path, {"device": "d"}, {"k": _tuning()})
    assert list(tuning_store.load(path, {"device": "d"})) == ["k"]


def test_an_infinite_number_in_a_store_entry_is_corrupt(tmp_path):
    """``json`` reads ``Infinity``; ``int()`` of it raises OverflowError, which escaped the
    corrupt-file handling (ValueError, TypeError, KeyError, AttributeError)."""
    path = tmp_path / "x.json"
    assert tuning_store.save(path, {"device": "d"}, {"k": _tuning()})
    document = json.loads(path.read_text())
    document["entries"]["k"]["m"] = float("inf")
    path.write_text(json.dumps(document))
    with pytest.warns(tuning_store.AutotuneCacheWarning, match="corrupt"):
        assert tuning_store.load(path, {"device": "d"}) == {}


# ---- explain / describe_problem -----------------------------------------------------------


def test_only_wgrad_can_be_explained_with_accumulate(gen):
    """``explain(op="fwd", accumulate=True)`` with tensors dropped the flag silently, and
    described (also ``grouped-gemm explain --op fwd --accumulate``) routed a "fwd ...
    (accumulate)" problem that no call can make."""
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    with pytest.raises(gg.InvalidArgumentError, match=r"^accumulate=True .*op='fwd'"):
        gg.explain(x, w, [2, 4], op="fwd", accumulate=True)
    with pytest.raises(gg.InvalidArgumentError, match=r"^accumulate=True .*op='dgrad'"):
        gg.describe_problem(op="dgrad", groups=2, m=6, n=3, k=4, accumulate=True)
    assert gg.describe_problem(op="wgrad", groups=2, m=6, n=3, k=4, accumulate=True).accumulate


@pytest.mark.parametrize("spoil", [lambda p: torch.randn(N, K + 1), lambda p: p.detach().double()])
def test_a_replaced_first_expert_weight_is_the_one_named(spoil, gen):
    """Weight lists were checked against ``w[0]``: with ``weight0`` of a ``separate_weights``
    layer replaced by one of another shape or dtype, the error blamed ``w[1]`` and claimed
    every expert's weight should look like the new one."""
    layer = gg.GroupedLinear(3, K, N, recipe="fp32", separate_weights=True)
    layer.weight0 = torch.nn.Parameter(spoil(layer.weight0))
    with pytest.raises(gg.GroupedGemmError, match=r"^w\[0\]="):
        layer(torch.randn(9, K, generator=gen), [3, 3, 3])


@pytest.mark.parametrize("call", ["rows", "offsets"])
@pytest.mark.parametrize("splits", [[2, 4], torch.tensor([2, 4])], ids=["host", "tensor"])
def test_an_align_past_int32_offsets_is_named(call, splits):
    """``align=2**40`` failed in torch ("value cannot be converted to type int32 without
    overflow") where the int32 row offsets were built."""
    with pytest.raises(gg.InvalidArgumentError, match=r"^align=.*int32"):
        if call == "rows":
            gg.quantize_mx_rows(torch.randn(6, 32), splits, "e4m3", align=2**40)
        else:
            gg.mx.padded_row_offsets(splits, 6, "cpu", 2**40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_padded_row_offsets_names_a_gpu_that_is_not_there():
    """``device="cuda"`` without a GPU failed in torch's pinned-memory copy ("pin_memory=True
    requires a CUDA or other accelerator backend")."""
    with pytest.raises(gg.InvalidArgumentError, match=r"^device='cuda'.*visible"):
        gg.mx.padded_row_offsets([2, 4], 6, "cuda")
