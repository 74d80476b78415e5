"""Adversarial cases from the module pass: ``GroupedLinear`` and ``grouped_linear``
(``main_grad`` buffers, separate biases, copies of frozen MX weights, compiled fused
layers), the custom ops, expert parallelism (``all_to_all``, ranks that disagree,
``load_full_state_dict``). Each failed before its fix; CPU only, small shapes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

import grouped_gemm as gg
from grouped_gemm.parallel import ExpertParallelMoE
from grouped_gemm.testing import rel_error

G, K, N = 3, 8, 4
SPLITS = [2, 0, 5]

# ---- main_grad buffers that alias another expert's weight or buffer ---------------------------


def _views_one_row_apart(flat: torch.Tensor) -> list[torch.Tensor]:
    """G ``(N, K)`` views of ``flat`` whose starts are one row apart: each overlaps the next."""
    return [flat[g * K : g * K + N * K].view(N, K) for g in range(G)]


ALIASING_MAIN_GRADS: dict[str, Callable[[gg.GroupedLinear], list[torch.Tensor]]] = {
    "one_buffer_for_every_expert": lambda layer: [torch.zeros(N, K)] * G,
    "another_experts_weight": lambda layer: [torch.zeros(N, K), layer.weight0.data, torch.zeros(N, K)],
    "overlapping_views": lambda layer: _views_one_row_apart(torch.zeros(G * N * K)),
}


@pytest.mark.parametrize("bad", list(ALIASING_MAIN_GRADS))
def test_a_main_grad_aliasing_another_expert_is_named_at_forward(bad, gen):
    """Only a main_grad sharing its *own* weight's memory was refused: one overlapping
    another expert's weight ran, and wgrad added into that weight silently; buffers
    shared between experts failed in backward as ``out=...`` (never passed by the caller)."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True)
    before = [w.detach().clone() for w in layer.weights]
    for w, buf in zip(layer.weights, ALIASING_MAIN_GRADS[bad](layer), strict=True):
        w.main_grad = buf
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    with pytest.raises(gg.InvalidArgumentError, match=r"^weight[12]\.main_grad=.*overlaps weight[01]"):
        layer(x, SPLITS)
    assert all(torch.equal(w, b) for w, b in zip(layer.weights, before, strict=True))


def test_a_main_grad_aliasing_another_expert_is_named_under_compile(gen):
    """Under torch.compile the overlap check (eager-only: Dynamo cannot read pointers) was
    skipped, and the compiled backward added wgrad into another expert's weight silently.
    The fwd op now checks at run time."""
    torch._dynamo.reset()
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True)
    before = [w.detach().clone() for w in layer.weights]
    for w, buf in zip(layer.weights, ALIASING_MAIN_GRADS["another_experts_weight"](layer), strict=True):
        w.main_grad = buf
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    try:
        with pytest.raises(gg.InvalidArgumentError, match=r"^weight1\.main_grad=.*overlaps weight0"):
            compiled(x, torch.tensor(SPLITS)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(w, b) for w, b in zip(layer.weights, before, strict=True))


def test_main_grads_of_mixed_dtypes_are_named_at_forward(gen):
    """Each buffer's dtype was checked alone: fp32 and bf16 buffers passed the forward and
    backward failed as ``out[1]=... every group's weight has dtype torch.float32``."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True)
    for g, w in enumerate(layer.weights):
        w.main_grad = torch.zeros(N, K, dtype=torch.bfloat16 if g == 1 else torch.float32)
    x = torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True)
    with pytest.raises(gg.DTypeError, match=r"^weight1\.main_grad=.*like weight0\.main_grad"):
        layer(x, SPLITS)


def test_distinct_main_grads_in_one_flat_buffer_accumulate(gen):
    """Megatron's layout: every main_grad a view into one flat grad buffer, back to back."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True, fuse_wgrad_accumulation=True, bias=False)
    flat = torch.randn(G * N * K, generator=gen)
    start = flat.clone()
    for g, w in enumerate(layer.weights):
        w.main_grad = flat[g * N * K : (g + 1) * N * K].view(N, K)
    x = torch.randn(sum(SPLITS), K, generator=gen, dtype=torch.float64)
    dy = torch.randn(sum(SPLITS), N, generator=gen, dtype=torch.float64)
    layer(x.float(), SPLITS).backward(dy.float())
    want = torch.cat([d.T @ a for d, a in zip(dy.split(SPLITS), x.split(SPLITS), strict=True)]).flatten()
    assert torch.allclose(flat.double() - start.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen_weights"])
def test_a_compiled_fused_layer_needs_no_main_grad_without_weight_gradients(mode, gen):
    """Eager, a fused layer asks for main_grad only when the call will produce weight
    gradients; compiled, it asked always: inference (or training only the input) of a
    compiled fused layer failed for the missing main_grad (under fullgraph as Dynamo's
    'Attempted to call a super() attribute')."""
    torch._dynamo.reset()
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", fuse_wgrad_accumulation=True)
    if mode == "frozen_weights":
        layer.requires_grad_(False)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(sum(SPLITS), K, generator=gen, dtype=torch.float64)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    want = torch.cat([a @ w[g].T + b[g] for g, a in enumerate(x.split(SPLITS))])
    xin = x.float().requires_grad_(mode == "frozen_weights")
    try:
        with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)():
            y = compiled(xin, torch.tensor(SPLITS))
        assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)
        if mode == "frozen_weights":
            dy = torch.randn(sum(SPLITS), N, generator=gen, dtype=torch.float64)
            y.backward(dy.float())
            want_dx = torch.cat([d @ w[g] for g, d in enumerate(dy.split(SPLITS))])
            assert torch.allclose(xin.grad.double(), want_dx, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def _fused_layer(separate: bool) -> gg.GroupedLinear:
    layer = gg.GroupedLinear(
        G, K, N, bias=False, recipe="fp32", separate_weights=separate, fuse_wgrad_accumulation=True
    )
    for w in layer.weights:
        w.main_grad = torch.zeros_like(w)
    return layer


def _wgrad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return torch.stack([d.double().T @ a.double() for d, a in zip(dy.split(SPLITS), x.split(SPLITS), strict=True)])


@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("ask", ["backward_inputs_x", "autograd_grad_x"])
def test_fused_wgrad_adds_nothing_when_only_the_input_gradient_is_asked(ask, separate, gen):
    """``backward(inputs=[x])`` or ``torch.autograd.grad(loss, x)`` (a gradient penalty) on
    a fused layer added the weight gradient into main_grad anyway, so the step's real
    backward left it at twice the true gradient; a non-fused layer leaves .grad alone."""
    layer = _fused_layer(separate)
    x = torch.randn(sum(SPLITS), K, generator=gen).requires_grad_()
    dy = torch.randn(sum(SPLITS), N, generator=gen)
    y = layer(x, SPLITS)
    if ask == "backward_inputs_x":
        y.backward(dy, inputs=[x])
    else:
        torch.autograd.grad(y, x, dy)
    assert all(not w.main_grad.any() for w in layer.weights)
    layer(x, SPLITS).backward(dy)  # the step's backward: exactly one wgrad
    got = torch.stack([w.main_grad for w in layer.weights]) if separate else layer.weight.main_grad
    assert torch.allclose(got.double(), _wgrad(x.detach(), dy), rtol=1e-5, atol=1e-5)


def test_autograd_grad_of_a_fused_weight_returns_it(gen):
    """Inside ``torch.autograd.grad`` the fused layer returns the weight gradient asked for
    (the engine does not say whether a leaf is asked, so nothing is accumulated there)."""
    layer = _fused_layer(False)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    dy = torch.randn(sum(SPLITS), N, generator=gen)
    (dw,) = torch.autograd.grad(layer(x, SPLITS), layer.weight, dy)
    assert torch.allclose(dw.double(), _wgrad(x, dy), rtol=1e-5, atol=1e-5)
    assert not layer.weight.main_grad.any()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_frozen_expert_of_a_fused_layer_gets_no_gradient_and_needs_no_main_grad(compiled, gen):
    """``separate_weights`` with one expert frozen (fine-tuning some experts): its main_grad
    received its wgrad, and without one (Megatron gives frozen parameters none) every forward
    failed."""
    torch._dynamo.reset()
    layer = _fused_layer(True)
    layer.weight1.requires_grad_(False)
    del layer.weight1.main_grad
    run = torch.compile(layer, backend="aot_eager") if compiled else layer
    x = torch.randn(sum(SPLITS), K, generator=gen)
    dy = torch.randn(sum(SPLITS), N, generator=gen)
    try:
        run(x, torch.tensor(SPLITS)).backward(dy)
    finally:
        torch._dynamo.reset()
    want = _wgrad(x, dy)
    assert not hasattr(layer.weight1, "main_grad") and layer.weight1.grad is None
    for g in (0, 2):
        assert torch.allclose(layer.weights[g].main_grad.double(), want[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_an_out_buffer_of_another_dtype_is_named_at_forward(compiled, gen):
    """Eager, an fp32 ``out`` for a bf16 layer (or the reverse) ran its forward and failed
    in backward with a DTypeError about ``dy``, an argument the caller never passed;
    compiled, the same call trained on a result rounded to the layer's dtype first."""
    torch._dynamo.reset()
    layer = gg.GroupedLinear(G, K, N, dtype=torch.bfloat16)
    run = torch.compile(layer, backend="aot_eager") if compiled else layer
    x = torch.randn(sum(SPLITS), K, generator=gen).bfloat16().requires_grad_()
    try:
        with pytest.raises(gg.DTypeError, match=r"^out=.*dtype torch\.bfloat16"):
            run(x, torch.tensor(SPLITS), out=torch.empty(sum(SPLITS), N))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_by_name(transform, gen):
    """torch.func.grad over functional_call (per-sample gradients, meta-learning) and vmap
    failed inside torch with its note about autograd.Function.setup_context."""
    layer = gg.GroupedLinear(G, K, N, dtype=torch.float32)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    with pytest.raises(gg.InvalidArgumentError, match=r"^grouped_linear=.*torch\.func"):
        if transform == "grad":
            torch.func.grad(lambda p: torch.func.functional_call(layer, p, (x, SPLITS)).sum())(params)
        else:
            torch.func.vmap(lambda xx: layer(xx, SPLITS))(x[None].expand(2, -1, -1))


# ---- separate_weights: a replaced bias{i} ------------------------------------------------------


@pytest.mark.parametrize(
    ("bias1", "error"),
    [
        (None, gg.InvalidTypeError),
        (torch.nn.Parameter(torch.zeros(N + 1)), gg.ShapeError),
        (torch.nn.Parameter(torch.zeros(1, N)), gg.ShapeError),
        (torch.nn.Parameter(torch.zeros(N, device="meta")), gg.DeviceMismatchError),
    ],
)
def test_a_replaced_separate_bias_is_named(bias1, error, gen):
    """``torch.stack(self.biases)`` ran unchecked: ``RuntimeError: stack expects each
    tensor to be equal size`` or ``TypeError: expected Tensor as element 1``, naming no
    parameter. Weights replaced the same way were already named (``w[1]``)."""
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True)
    layer.bias1 = bias1
    with pytest.raises(error, match=r"^bias1="):
        layer(torch.randn(sum(SPLITS), K, generator=gen), SPLITS)


def test_separate_biases_still_add_per_expert(gen):
    layer = gg.GroupedLinear(G, K, N, recipe="fp32", separate_weights=True)
    x = torch.randn(sum(SPLITS), K, generator=gen)
    want = torch.cat(
        [
            a.double() @ w.double().T + b.double()
            for a, w, b in zip(x.split(SPLITS), layer.weights, layer.biases, strict=True)
        ]
    )
    assert torch.allclose(layer(x, SPLITS).double(), want, atol=1e-5, rtol=1e-5)


# ---- copies of a layer with frozen MX weights ---------------------------------------------------


def _copy(layer: gg.GroupedLinear, how: str) -> gg.GroupedLinear:
    if how == "deepcopy":
        return copy.deepcopy(layer)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("separate", [False, True])
def test_a_copy_of_a_frozen_layer_runs_and_stays_checked(how, separate, gen):
    """The frozen copy's stamp holds the weights' identities and pointers, which a copy's
    weights never match: a deepcopy or a torch.save/torch.load of a frozen layer, weights
    untouched, refused every forward with ``weight='changed since freeze_quantized_weights()'``.
    Now a copy re-stamps a valid frozen copy; a stale one stays refused, and later changes to
    the copy's weights are still caught."""
    torch.manual_seed(5)
    layer = gg.GroupedLinear(2, 64, 32, recipe="mxfp8", separate_weights=separate).requires_grad_(False)
    x = torch.randn(10, 64, generator=gen).bfloat16()
    with gg.use_backends("reference", strict=True):
        layer.freeze_quantized_weights()
        want = layer(x, [4, 6])
        twin = _copy(layer, how)
        assert twin.frozen and torch.equal(twin(x, [4, 6]), want)
        with torch.no_grad():
            twin.weights[0].mul_(2)
        with pytest.raises(gg.InvalidArgumentError, match="changed since freeze_quantized_weights"):
            twin(x, [4, 6])
        with torch.no_grad():
            layer.weights[-1].mul_(2)  # the original goes stale: so must its copies
        with pytest.raises(gg.InvalidArgumentError, match="changed since freeze_quantized_weights"):
            _copy(layer, how)(x, [4, 6])


# ---- grouped_linear's weight and flag ---------------------------------------------------------


@pytest.mark.parametrize("weight", [None, 5, "w", {"w": 1}])
def test_grouped_linear_names_a_weight_that_is_not_a_tensor_or_list(weight, gen):
    """``list(weight)`` ran first: None or an int escaped as ``TypeError: ... is not
    iterable``, a str or dict as ``AttributeError: 'str' object has no attribute 'dim'``."""
    x = torch.randn(sum(SPLITS), K, generator=gen)
    with pytest.raises(gg.InvalidTypeError, match=r"^weight=.*\(G, N, K\) tensor or a list"):
        gg.grouped_linear(x, weight, SPLITS, recipe="fp32")


@pytest.mark.parametrize("flag", [1, "no", None])
def test_grouped_linear_names_a_non_bool_fuse_flag(flag, gen):
    """Any truthy value turned fused accumulation on (``"no"`` included), any falsy one off,
    where ``GroupedLinear`` refuses them: now the functional form refuses them too."""
    x = torch.randn(sum(SPLITS), K, generator=gen)
    w = torch.randn(G, N, K, generator=gen, requires_grad=True)
    with pytest.raises(gg.InvalidTypeError, match=r"^fuse_wgrad_accumulation=.*True or False"):
        gg.grouped_linear(x, w, SPLITS, recipe="fp32", fuse_wgrad_accumulation=flag)


# ---- torch.ops.grouped_gemm.bias_grad checks its splits --------------------------------------


@pytest.mark.parametrize(
    ("splits", "splits_tensor", "error"),
    [
        ([2, 0, 9], None, gg.SplitsError),  # sums past dy's 7 rows
        (None, torch.tensor([2, 0, 9]), gg.SplitsError),
        ([9, -2, 0], None, gg.SplitsError),
        (None, torch.tensor([2.0, 0.0, 5.0]), gg.SplitsError),
        (None, None, gg.InvalidTypeError),
    ],
)
def test_bias_grad_op_checks_its_splits(splits, splits_tensor, error, gen):
    """segment_reduce(unsafe=True) trusted the lengths: splits summing past dy's rows read
    the memory after dy (here 1e30s that came out in the sum), a negative size failed in
    torch ('Expected segment_length >= 0'), float or missing splits slipped through or
    failed as a bare TypeError."""
    memory = torch.randn(20, N, generator=gen)
    memory[7:] = 1e30
    dy = memory[:7]
    with pytest.raises(error, match=r"^m_splits="):
        torch.ops.grouped_gemm.bias_grad(dy, splits, splits_tensor)


@pytest.mark.parametrize("op", ["fwd", "wgrad", "bias_grad"])
def test_ops_refuse_both_splits_forms(op, gen):
    """The ops take exactly one of splits and splits_tensor; given both (here disagreeing)
    they used the list and ignored the tensor."""
    x = torch.randn(sum(SPLITS), K, generator=gen)
    dy = torch.randn(sum(SPLITS), N, generator=gen)
    w = torch.randn(G, N, K, generator=gen)
    both = (SPLITS, torch.tensor(SPLITS[::-1]))
    call = {
        "fwd": lambda: torch.ops.grouped_gemm.fwd(x, [w], None, *both, "fp32", None),
        "wgrad": lambda: torch.ops.grouped_gemm.wgrad(dy, x, *both, "fp32"),
        "bias_grad": lambda: torch.ops.grouped_gemm.bias_grad(dy, *both),
    }[op]
    with pytest.raises(gg.InvalidArgumentError, match=r"^splits_tensor=.*exactly one"):
        call()


def test_bias_grad_op_sums_each_group(gen):
    dy = torch.randn(7, N, generator=gen)
    for splits, splits_tensor in (([2, 0, 5], None), (None, torch.tensor([2, 0, 5]))):
        got = torch.ops.grouped_gemm.bias_grad(dy, splits, splits_tensor)
        want = torch.stack([part.double().sum(0) for part in dy.split([2, 0, 5])])
        assert torch.allclose(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("bias", "error"),
    [
        (torch.ones(G, 1), gg.ShapeError),  # broadcast over N: every output moved by 1, silently
        (torch.ones(1, N), gg.ShapeError),
        (torch.ones(G * N), gg.ShapeError),
        (torch.ones(G, N, dtype=torch.int64), gg.DTypeError),
    ],
)
@pytest.mark.parametrize("tensor_splits", [False, True])
def test_fwd_op_checks_its_bias(bias, error, tensor_splits, gen):
    """``torch.ops.grouped_gemm.fwd`` (what grouped_linear runs under torch.compile, and the
    documented entry for double backward) added any bias that repeat_interleave and add_
    accepted: a ``(G, 1)`` bias broadcast over N; others failed inside torch."""
    x = torch.randn(sum(SPLITS), K, generator=gen)
    w = torch.randn(G, N, K, generator=gen)
    splits, splits_tensor = (None, torch.tensor(SPLITS)) if tensor_splits else (SPLITS, None)
    with pytest.raises(error, match=r"^bias="):
        torch.ops.grouped_gemm.fwd(x, [w], bias, splits, splits_tensor, "fp32", None)


# ---- all_to_all: each rank's splits are checked before the exchange ---------------------------

BAD_EXCHANGES: dict[str, tuple[list, list, str]] = {
    # (send_splits, recv_splits, argument named) for 5 rows on each of 2 ranks
    "negative_send": ([6, -1], [5, 5], "send_splits"),
    "negative_recv": ([2, 3], [6, -1], "recv_splits"),
    "float_sizes": ([2.5, 2.5], [5, 5], "send_splits"),
    "bool_sizes": ([True, 4], [5, 5], "send_splits"),
    "one_size_for_two_ranks": ([5], [5, 5], "send_splits"),
    "sizes_not_summing_to_rows": ([2, 2], [4, 4], "send_splits"),
    # The rows a rank keeps differ from what it expects from itself: gloo aborted with a bare
    # enforce failure; NCCL has no such check.
    "rows_to_itself_differ": ([2, 3], [3, 2], "recv_splits"),
}


# ExpertParallelMoE arguments that differ between rank 0 and rank 1.
MISMATCHES: dict[str, Callable[[int], dict]] = {
    "num_experts": lambda rank: {"num_experts": 4 + 4 * rank},
    "dtype": lambda rank: {"dtype": (torch.float32, torch.bfloat16)[rank]},
    "ffn": lambda rank: {"ffn": 6 + 2 * rank},
    # These two ran silently: the ranks' experts or tokens computed as different layers.
    "recipe": lambda rank: {
        "recipe": ("mxfp8", gg.get_recipe("mxfp8").model_copy(update={"scale_rule": "floor"}))[rank]
    },
    "normalize_weights": lambda rank: {"normalize_weights": bool(rank)},
}


def _exchange_worker(rank: int, store: str, out_dir: str) -> None:
    """One of 2 gloo ranks: every bad exchange is refused on the rank (before the collective,
    so no peer waits), then a good one still moves the right rows and gradients."""
    from datetime import timedelta

    import torch.distributed as dist

    from grouped_gemm.parallel import all_to_all

    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    results: dict[str, object] = {}
    try:
        rows = torch.randn(5, 3)
        for group in ("world", 3):
            try:
                all_to_all(rows, [2, 3], [2, 3], group)
                results[f"group={group!r}"] = "returned"
            except gg.InvalidTypeError as e:
                results[f"group={group!r}"] = e.argument
        # Rank 1 is left out of this group: new_group gives it GroupMember.NON_GROUP_MEMBER.
        only_rank0 = dist.new_group([0])
        for name, use in {
            "group": lambda: all_to_all(rows, [5], [5], only_rank0).shape,
            "process_group": lambda: ExpertParallelMoE(4, 8, 6, 2, process_group=only_rank0).world_size,
        }.items():
            try:
                results[f"outside {name}"] = repr(use())
            except gg.InvalidArgumentError as e:
                results[f"outside {name}"] = str(e)
        for name, (send, recv, _) in BAD_EXCHANGES.items():
            try:
                all_to_all(rows, send, recv, dist.group.WORLD)
                results[name] = "returned"
            except gg.InvalidArgumentError as e:
                results[name] = e.argument
        # Rank r sends its rows [0, 1 + r) to rank 0 and the rest to rank 1.
        rows = (10 * rank + torch.arange(5, dtype=torch.float64)).requires_grad_()
        send = [1 + rank, 4 - rank]
        recv = [1, 2] if rank == 0 else [4, 3]
        got = all_to_all(rows[:, None], send, recv, dist.group.WORLD)
        (got[:, 0] * (100 + torch.arange(got.shape[0]))).sum().backward()
        results["received"] = got[:, 0].tolist()
        results["grad"] = rows.grad.tolist()
        # Layers that differ between the ranks: refused on every rank, before any exchange.
        for name, kwargs in MISMATCHES.items():
            layer = ExpertParallelMoE(**{"num_experts": 4, "hidden": 8, "ffn": 6, "top_k": 2, **kwargs(rank)})
            try:
                if name == "ffn":  # forward exchanges the same sizes: gathering the shards fails
                    layer.full_state_dict()
                else:
                    layer(torch.randn(3, 8, dtype=layer.router.weight.dtype))
                results[f"mismatched {name}"] = "returned"
            except gg.InvalidArgumentError as e:
                results[f"mismatched {name}"] = e.argument
                results[f"mismatched {name} message"] = str(e)
        torch.manual_seed(0)  # the same layer on both ranks: it runs
        layer = ExpertParallelMoE(4, 8, 6, 2, dtype=torch.float32)
        results["matched"] = list(layer(torch.randn(3 + rank, 8)).shape)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def test_all_to_all_and_expert_parallel_check_each_rank(tmp_path):
    """A negative split passed to gloo failed its bounds check and corrupted the heap
    (``malloc(): unaligned tcache chunk``, the process aborted); float, wrong-length or
    mis-summed splits failed deep in torch.distributed, a group that is not a ProcessGroup
    as ``AttributeError: 'str' object has no attribute 'size'``, and a group this rank is not
    in (``new_group``'s ``NON_GROUP_MEMBER``) as "group=-100 ... a ProcessGroup", which did
    not say why. Now each is named on its rank.
    ExpertParallelMoE layers that differ between the ranks (num_experts, dtype) made gloo
    abort the process ('Received data size doesn't match expected size'), or (ffn) gather
    shards that do not fit, or (recipe, normalize_weights) ran as different layers, silently;
    now every rank names the difference at the first forward or full_state_dict."""
    results = run_ranks(__file__, "--exchange-worker", tmp_path, timeout_s=60)
    for res in results:
        assert res["group='world'"] == res["group=3"] == "group"
        assert {name: res[name] for name in BAD_EXCHANGES} == {name: arg for name, (_, _, arg) in BAD_EXCHANGES.items()}
    assert results[0]["outside group"] == "torch.Size([5, 3])" and results[0]["outside process_group"] == "1"
    for name in ("group", "process_group"):
        assert results[1][f"outside {name}"].startswith(
            f"{name}='GroupMember.NON_GROUP_MEMBER (-100)' is invalid: a group this rank (global rank 1) belongs to"
        ), results[1]
    for rank, res in enumerate(results):
        assert {name: res[f"mismatched {name}"] for name in MISMATCHES} == {name: name for name in MISMATCHES}
        other = ["mxfp8;scale_rule=floor;grad_format=e4m3", "mxfp8"][rank]
        assert f"like rank {1 - rank}'s {other} (one layer)" in res["mismatched recipe message"], res
        assert res["matched"] == [3 + rank, 8]
    assert results[0]["received"] == [0.0, 10.0, 11.0]
    assert results[1]["received"] == [1.0, 2.0, 3.0, 4.0, 12.0, 13.0, 14.0]
    # d(sum_i got[i] * (100 + i)) / d(rows): each row's gradient is its weight where it arrived.
    assert results[0]["grad"] == [100.0, 100.0, 101.0, 102.0, 103.0]
    assert results[1]["grad"] == [101.0, 102.0, 104.0, 105.0, 106.0]


@pytest.mark.parametrize("activation", [["relu"], {"swiglu": 1}, None, 3])
def test_an_unhashable_or_non_string_activation_is_named(activation):
    """``activation=["relu"]`` escaped as ``TypeError: unhashable type: 'list'``."""
    with pytest.raises(gg.InvalidArgumentError, match=r"^activation=.*one of"):
        ExpertParallelMoE(4, 8, 6, 2, recipe="fp32", activation=activation)


@pytest.mark.parametrize(("dtype", "recipe"), [(None, "bf16"), (torch.float32, "fp32"), (torch.float16, "fp16")])
def test_expert_parallel_dtype_alone_picks_the_plain_recipe(dtype, recipe, gen):
    """The layer's default recipe was "bf16", so ``dtype=torch.float32`` alone was refused
    (``recipe bf16 computes in torch.bfloat16``) although ``GroupedLinear`` takes it."""
    layer = ExpertParallelMoE(4, 8, 6, 2, dtype=dtype)
    want = dtype or torch.bfloat16
    assert layer.gate_up.recipe.name == layer.down.recipe.name == recipe
    assert {p.dtype for p in layer.parameters()} == {want}
    x = torch.randn(5, 8, generator=gen).to(want)
    assert layer(x).dtype == want


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda state: None, "state"),
        (lambda state: list(state.items()), "state"),
        (lambda state: {**state, "down.weight": state["down.weight"].tolist()}, r"state\['down.weight'\]"),
    ],
)
def test_load_full_state_dict_names_what_is_not_a_state(change, name):
    """None escaped as ``TypeError: 'NoneType' object is not iterable``, an expert value
    that is not a tensor as ``AttributeError: 'list' object has no attribute 'dim'``."""
    layer = ExpertParallelMoE(4, 8, 6, 2, recipe="fp32")
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(gg.InvalidTypeError, match=rf"^{name}="):
        layer.load_full_state_dict(change(ExpertParallelMoE(4, 8, 6, 2, recipe="fp32").state_dict()))
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


if __name__ == "__main__" and sys.argv[1] == "--exchange-worker":
    _exchange_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    # Done and the group destroyed: skip interpreter teardown, where gloo's threads of a
    # group still referenced (the layers hold theirs) can abort the process at random
    # ('terminate called without an active exception', about 1 run in 10 here).
    os._exit(0)


@pytest.mark.parametrize("out", ["y", [torch.empty(7, N)], 0.0], ids=["str", "list", "float"])
@pytest.mark.parametrize("layer", [False, True])
def test_an_out_that_is_not_a_tensor_is_named(out, layer, gen):
    """``grouped_linear(..., out=[t])`` and ``GroupedLinear(...)(x, s, out="y")`` failed with
    a bare AttributeError (``'list' object has no attribute 'requires_grad'``)."""
    x = torch.randn(sum(SPLITS), K, generator=gen)
    module = gg.GroupedLinear(G, K, N, dtype=torch.float32)
    with pytest.raises(gg.InvalidTypeError, match=r"^out="):
        if layer:
            module(x, SPLITS, out=out)
        else:
            gg.grouped_linear(x, module.weight, SPLITS, out=out)


def _nested(parts: list[torch.Tensor]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "nested tensors are in prototype stage"
        return torch.nested.nested_tensor(parts)


def _with_nested_bias(gen: torch.Generator) -> None:
    x = torch.randn(sum(SPLITS), K, generator=gen)
    gg.grouped_linear(x, torch.randn(G, N, K, generator=gen), SPLITS, bias=_nested([torch.zeros(N)] * G))


def _with_nested_separate_bias(gen: torch.Generator) -> None:
    layer = gg.GroupedLinear(G, K, N, dtype=torch.float32, separate_weights=True)
    layer.bias1 = torch.nn.Parameter(_nested([torch.zeros(N)]))
    layer(torch.randn(sum(SPLITS), K, generator=gen), SPLITS)


def _with_nested_main_grad(gen: torch.Generator) -> None:
    layer = gg.GroupedLinear(G, K, N, dtype=torch.float32, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = _nested([torch.zeros(N, K)] * G)
    layer(torch.randn(sum(SPLITS), K, generator=gen, requires_grad=True), SPLITS)


def _with_nested_weight_item(gen: torch.Generator) -> None:
    gg.quantize_mx_weight([_nested([torch.zeros(32)] * 2)] * G, "e4m3")


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [
        (_with_nested_bias, gg.InvalidArgumentError, "bias"),
        (_with_nested_separate_bias, gg.InvalidArgumentError, "bias1"),
        (_with_nested_main_grad, gg.InvalidArgumentError, r"weight\.main_grad"),
        (_with_nested_weight_item, gg.InvalidTypeError, "w"),
    ],
    ids=["bias", "separate_bias", "main_grad", "quantize_mx_weight_list"],
)
def test_a_nested_tensor_is_named(call, error, name, gen):
    """A nested tensor of 1-D parts has dim() 2 and the strided layout, so it passed the
    rank checks and failed in torch: "NestedTensorImpl doesn't support sizes"."""
    with pytest.raises(error, match=rf"^{name}=.*nested"):
        call(gen)


def test_a_biased_layer_and_row_quantization_ignore_the_default_device(gen):
    """Host splits were turned into a tensor on torch's default device: under
    ``torch.device("meta")`` (or a GPU default) a biased layer's forward on CPU tensors
    failed naming its own bias, and ``quantize_mx_rows`` failed inside torch."""
    layer = gg.GroupedLinear(3, 8, 4, bias=True, dtype=torch.float32)
    x, splits = torch.randn(6, 8, generator=gen), [2, 0, 4]
    want = torch.cat([x[:2].double() @ layer.weight[0].double().T, x[2:].double() @ layer.weight[2].double().T])
    want += torch.repeat_interleave(layer.bias.detach().double(), torch.tensor(splits), dim=0)
    rows = torch.randn(64, 32, generator=gen)
    plain = gg.quantize_mx_rows(rows, [32, 0, 32], "e4m3").dequantize()
    with torch.device("meta"):
        y = layer(x, splits)
        quantized = gg.quantize_mx_rows(rows, [32, 0, 32], "e4m3").dequantize()
    assert y.device.type == "cpu" and rel_error(y.detach(), want) < 1e-5
    assert quantized.device.type == "cpu" and torch.equal(quantized, plain)
