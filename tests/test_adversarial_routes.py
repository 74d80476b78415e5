"""Adversarial cases for the call path's fast paths: the per-M Problems of a cached route
(``_Routed.by_m``) under concurrent calls, the weight-list and MX fast paths of validation
(the error names the weight at fault; MX operands on the meta device), and an ``out=``
buffer that requires grad; nested and meta operands of ``gmm``. Each failed before its fix
(d918dab and later); CPU only, small shapes.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import dispatch
from grouped_gemm.backend import gmm as backend_gmm
from grouped_gemm.mx import MXTensor
from grouped_gemm.ops import gmm as ops_gmm
from grouped_gemm.testing import ref_fwd, rel_error

# ---- a route's Problems per M under concurrent calls ----------------------------------------


def test_two_threads_evicting_a_routes_oldest_problem_do_not_raise(gen):
    """Two threads whose new M arrive at a full route at once both evict: each reads the
    oldest M (``next(iter(by_m))``) before either deletes it, and the second ``del`` raises
    a bare ``KeyError`` out of ``gg.grouped_gemm`` (d918dab, ``Dispatcher.run``). Seen
    through the public API alone too: 8 threads calling M in one bucket of 2048 values
    (``backend="reference"``) raise ``KeyError: <M>`` about twice a second on the dev CPU.

    Here the window is held open deterministically: the route's dict meets both threads
    right after the oldest key is read (a serialized or tolerant eviction passes)."""
    n, k = 3, 5  # shapes no other route of this test has
    x, w = torch.randn(2400, k, generator=gen), torch.randn(1, n, k, generator=gen)
    # One route (M bucket 4096, G=1, max_rows 4096, odd M: m_align 1), filled with Problems.
    filled = [2049 + 2 * i for i in range(dispatch.MAX_PROBLEMS_PER_ROUTE)]
    for m in filled:
        gg.grouped_gemm(x[:m], w, [m], backend="reference")
    routes = [r for r in list(dispatch.DISPATCHER._cache.values()) if (r.problem.n, r.problem.k) == (n, k)]
    assert len(routes) == 1
    routed = routes[0]

    meet = threading.Barrier(2)
    base = type(routed.by_m)

    class Meeting(base):  # type: ignore[misc, valid-type]
        def __iter__(self):
            keys = base.__iter__(self)
            oldest = next(keys)
            # The other thread's eviction reads the same oldest M; under a lock (one
            # eviction at a time) there is no one to meet and the wait times out.
            with contextlib.suppress(threading.BrokenBarrierError):
                meet.wait(timeout=1.0)
            yield oldest
            yield from keys

    routed.by_m = Meeting(routed.by_m)
    new = [2301, 2303]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def call(m: int) -> None:
        try:
            results[m] = gg.grouped_gemm(x[:m], w, [m], backend="reference")
        except Exception as exc:  # noqa: BLE001 - every error is the finding
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(m,)) for m in new]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert not errors, [f"{type(e).__name__}: {e}" for e in errors]
    for m in new:
        assert rel_error(results[m], ref_fwd(x[:m], w, [m])) < 1e-6


# ---- weight lists: the error names the group's weight at fault ------------------------------


@pytest.mark.parametrize("op", ["fwd", "dgrad"])
@pytest.mark.parametrize(
    "spoil, allowed",
    [
        (lambda t: t.requires_grad_(), "does not require grad"),
        (lambda t: t.to_sparse(), "dense"),
    ],
    ids=["requires_grad", "sparse"],
)
def test_a_weight_list_error_names_the_group_at_fault(op, spoil, allowed, gen):
    """d765085 checks every weight of a list for grad and layout, but reports a later one as
    ``w=Tensor(shape=(N, K))``: with 64 experts the user cannot tell which. Every other check
    of a weight list (shape, dtype, device) says ``w[i]=``, as wgrad's out list now does
    (``out[1]=``, b17b08f)."""
    g, m, n, k = 3, 6, 4, 8
    w = [torch.randn(n, k, generator=gen) for _ in range(g)]
    w[2] = spoil(w[2])
    a = torch.randn(m, k if op == "fwd" else n, generator=gen)
    fn = gg.grouped_gemm if op == "fwd" else gg.grouped_gemm_dgrad
    with pytest.raises(gg.InvalidArgumentError, match=rf"^w\[2\]=.*{allowed}"):
        fn(a, w, [2, 0, 4])


# ---- MX operands on the meta device ----------------------------------------------------------


def _on_meta(t: MXTensor) -> MXTensor:
    return t.to("meta")


def test_mx_operands_on_meta_are_refused_like_plain_ones(gen):
    """Plain meta operands are refused (``x=... meta tensors have none``), and 45df439 made
    the test look at whichever operand is a plain tensor; when both are MXTensors there is
    none, so a meta call runs: ``backend="reference"`` returns a meta tensor (no numbers),
    the default route raises ``BackendRunError`` from inside triton_mxfp8 ("Cannot copy out
    of meta tensor"). fwd, dgrad and wgrad alike."""
    x = _on_meta(gg.quantize_mx(torch.randn(4, 64, generator=gen), "e4m3", axis=1))
    w_fwd = _on_meta(gg.quantize_mx_weight(torch.randn(2, 32, 64, generator=gen), "e4m3", op="fwd"))
    with pytest.raises(gg.DeviceMismatchError, match=r"^x=.*meta"):
        gg.grouped_gemm(x, w_fwd, [2, 2], backend="reference")
    dy = _on_meta(gg.quantize_mx(torch.randn(4, 32, generator=gen), "e4m3", axis=1))
    w_dgrad = _on_meta(gg.quantize_mx_weight(torch.randn(2, 32, 64, generator=gen), "e4m3", op="dgrad"))
    with pytest.raises(gg.DeviceMismatchError, match=r"^dy=.*meta"):
        gg.grouped_gemm_dgrad(dy, w_dgrad, [2, 2], backend="reference")
    dy_rows = _on_meta(gg.quantize_mx(torch.randn(64, 32, generator=gen), "e4m3", axis=0))
    x_rows = _on_meta(gg.quantize_mx(torch.randn(64, 64, generator=gen), "e4m3", axis=0))
    with pytest.raises(gg.DeviceMismatchError, match=r"^dy=.*meta"):
        gg.grouped_gemm_wgrad(dy_rows, x_rows, [32, 32], backend="reference")


def test_mx_operands_on_meta_are_refused_on_the_default_route(gen):
    """The same call without ``backend=``: a validation error naming x, not a
    ``BackendRunError`` from the kernel's host code."""
    x = _on_meta(gg.quantize_mx(torch.randn(4, 64, generator=gen), "e4m3", axis=1))
    w = _on_meta(gg.quantize_mx_weight(torch.randn(2, 32, 64, generator=gen), "e4m3", op="fwd"))
    with pytest.raises(gg.DeviceMismatchError, match=r"^x=.*meta"):
        gg.grouped_gemm(x, w, [2, 2])


# ---- out= that requires grad (pre-existing, found on the way) ---------------------------------


def test_an_out_buffer_that_requires_grad_is_refused_naming_out(gen):
    """Operands that require grad are refused with a message pointing at the differentiable
    layer; an ``out=`` leaf that requires grad instead escapes as a bare torch
    ``RuntimeError`` ("a leaf Variable that requires grad is being used in an in-place
    operation") from ``results.checked_result``'s ``out.copy_`` (fwd; wgrad's reaches the
    backend and comes back as ``BackendRunError``). Not from this session's commits."""
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    out = torch.zeros(6, 3, requires_grad=True)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*grad"):
        gg.grouped_gemm(x, w, [2, 4], out=out)


def _nested(parts: list[torch.Tensor]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor(parts)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda a, b, s: backend_gmm(_nested(list(a)), b, s), "a"),
        (lambda a, b, s: backend_gmm(a, _nested(list(b)), s), "b"),
        (lambda a, b, s: backend_gmm(a, b, s, c=_nested([torch.zeros(3)] * 6)), "c"),
        (lambda a, b, s: backend_gmm(a, _nested(list(a)), s, trans_a=True), "b"),
        (lambda a, b, s: ops_gmm(_nested(list(a)), b, s), "a"),
        (lambda a, b, s: ops_gmm(a, _nested(list(b)), s), "b"),
    ],
    ids=["gmm-a", "gmm-b", "gmm-c", "gmm-trans_a-b", "ops.gmm-a", "ops.gmm-b"],
)
def test_gmm_names_a_nested_operand(call, name, gen):
    """A nested tensor has the strided layout, so it passed the layout check and then
    failed in torch: "Internal error: NestedTensorImpl doesn't support sizes"."""
    a, b = torch.randn(6, 4, generator=gen), torch.randn(2, 4, 3, generator=gen)
    with pytest.raises(gg.InvalidArgumentError, match=rf"^{name}=.*nested"):
        call(a, b, torch.tensor([2, 4]))


def test_backend_gmm_names_a_meta_a(gen):
    """Both operands on meta were refused naming ``dy``, an argument gmm's caller never wrote."""
    a, b = torch.randn(6, 4, generator=gen).to("meta"), torch.randn(2, 4, 3, generator=gen).to("meta")
    with pytest.raises(gg.DeviceMismatchError, match=r"^a=.*meta"):
        backend_gmm(a, b, torch.tensor([2, 4]))


def test_ops_gmm_on_meta_still_infers_the_shape(gen):
    """The differentiable entry keeps running on meta tensors (its fake kernel), for shape inference."""
    a, b = torch.randn(6, 4, generator=gen).to("meta"), torch.randn(2, 4, 3, generator=gen).to("meta")
    assert ops_gmm(a, b, torch.tensor([2, 4])).shape == (6, 3)
