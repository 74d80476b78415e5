"""Public functions: the three grouped GEMMs, explain, registration and statistics."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from grouped_gemm import config, validation
from grouped_gemm.contract import BackendLike, BackendSpec, Reason
from grouped_gemm.decision import Decision
from grouped_gemm.device import DeviceInfo, described_device
from grouped_gemm.dispatch import DISPATCHER, call_order, check_names, decide
from grouped_gemm.errors import DTypeError, InvalidArgumentError, InvalidTypeError
from grouped_gemm.group_offsets import host_split_ints
from grouped_gemm.mx import MXTensor
from grouped_gemm.plugins import PluginFailure
from grouped_gemm.problem import OPS, Op, Problem, build_problem
from grouped_gemm.recipes import Recipe, get_recipe, plain_recipe_for
from grouped_gemm.registry import registry
from grouped_gemm.splits import balanced_splits, skewed_splits
from grouped_gemm.updates import count_writes
from grouped_gemm.vocabulary import FLOAT_DTYPE_NAMES, dtype_name

#: Groups a described problem may have: its splits are built as a host list.
MAX_DESCRIBED_GROUPS = 1 << 20


#: What Dynamo says where ``fullgraph=True`` meets a functional call.
_GRAPH_BREAK_REASON = (
    "gg.grouped_gemm / grouped_gemm_dgrad / grouped_gemm_wgrad run outside torch.compile graphs (one graph "
    "break); in graphs that must not break use gg.grouped_linear, gg.ops.gmm or torch.ops.grouped_gemm.*"
)


def _dispatch(validate: Any, args: tuple, backend: Any) -> Any:
    return DISPATCHER.run(validate(*args), backend)


#: ``DISPATCHER.run(validate(*args), backend)`` run eagerly when ``torch.compile`` meets a
#: functional call: one graph break there, instead of Dynamo tracing the dispatcher (its
#: caches, settings and host reads, which break the graph anyway and which a trace could
#: bake in). Graphs that must not break use ``grouped_linear`` / ``ops.gmm`` /
#: ``torch.ops.grouped_gemm.*``.
_outside_graph = torch.compiler.disable(_dispatch, reason=_GRAPH_BREAK_REASON)


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor | list[torch.Tensor],
    m_splits: Any,
    *,
    recipe: str | Recipe | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: Any = None,
) -> torch.Tensor:
    """Forward: ``out[rows of g] = x[rows of g] @ w[g].T`` -> ``(M, N)``.

    ``x`` is ``(M, K)``; ``w`` a ``(G, N, K)`` tensor or a list of G ``(N, K)`` tensors;
    ``m_splits`` G non-negative ints summing to M (list, tuple, or 1-D integer tensor on
    the host or the device). ``recipe`` defaults to the plain recipe of ``x``'s dtype.
    ``backend`` names a backend, a list of them, or an order string to prefer.
    """
    if torch.compiler.is_compiling():
        return _outside_graph(validation.fwd_or_dgrad, ("fwd", x, w, m_splits, recipe, out, out_dtype), backend)
    return DISPATCHER.run(validation.fwd_or_dgrad("fwd", x, w, m_splits, recipe, out, out_dtype), backend)


def grouped_gemm_dgrad(
    dy: torch.Tensor,
    w: torch.Tensor | list[torch.Tensor],
    m_splits: Any,
    *,
    recipe: str | Recipe | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: Any = None,
) -> torch.Tensor:
    """Input gradient: ``dx[rows of g] = dy[rows of g] @ w[g]`` -> ``(M, K)``."""
    if torch.compiler.is_compiling():
        return _outside_graph(validation.fwd_or_dgrad, ("dgrad", dy, w, m_splits, recipe, out, out_dtype), backend)
    return DISPATCHER.run(validation.fwd_or_dgrad("dgrad", dy, w, m_splits, recipe, out, out_dtype), backend)


def grouped_gemm_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_splits: Any,
    *,
    recipe: str | Recipe | None = None,
    out: torch.Tensor | list[torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    backend: Any = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Weight gradient: ``dw[g] = dy[rows of g].T @ x[rows of g]`` -> ``(G, N, K)``.

    With ``accumulate=True`` the result is added into ``out`` (for example an fp32
    ``main_grad``); groups without rows leave it untouched. Without it, empty groups
    give zeros. ``out`` may be a list of G ``(N, K)`` tensors (one per expert).
    """
    if torch.compiler.is_compiling():
        return _outside_graph(validation.wgrad, (dy, x, m_splits, recipe, out, out_dtype, accumulate), backend)
    return DISPATCHER.run(validation.wgrad(dy, x, m_splits, recipe, out, out_dtype, accumulate), backend)


def _check_accumulate(op: Any, accumulate: Any) -> None:
    """Only wgrad accumulates (``grouped_gemm_wgrad(..., accumulate=True)``): a fwd or dgrad
    decision "with accumulate" would describe a call that cannot be made."""
    if accumulate is True and op in OPS and op != "wgrad":
        raise InvalidArgumentError("accumulate", accumulate, f"False for op={op!r}; only wgrad accumulates into out")


def describe_problem(
    *,
    op: Op = "fwd",
    groups: int,
    m: int,
    n: int,
    k: int,
    recipe: str | Recipe | None = None,
    dtype: torch.dtype | str | None = None,
    out_dtype: torch.dtype | str | None = None,
    device: DeviceInfo | str | None = None,
    splits: str | list[int] = "balanced",
    device_splits: bool = False,
    accumulate: bool = False,
    weight_list: bool = False,
) -> Problem:
    """A Problem for a described call (no tensors), e.g. for ``explain`` on another chip.

    ``device`` is a DeviceInfo or an arch name (default: the ``use_device`` in force, else
    this machine's current device); ``splits`` is ``"balanced"``, ``"skewed"`` or explicit
    group sizes; ``recipe=None`` is the plain recipe of ``dtype`` (bf16 without one), as a
    call's operands pick it. The Problem is built as a real call with such tensors builds it.
    """
    if op not in OPS:
        raise InvalidArgumentError("op", op, f"one of {', '.join(OPS)}")
    for name, value in (("groups", groups), ("m", m), ("n", n), ("k", k)):
        low = 1 if name != "m" else 0
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value < 2**63:
            # 2**63: a tensor's dimension is an int64, so a larger one describes no call.
            allowed = "a positive integer" if low else "an integer >= 0"
            raise InvalidArgumentError(name, value, f"{allowed} below 2**63 (a tensor dimension)")
    if groups > MAX_DESCRIBED_GROUPS:
        raise InvalidArgumentError("groups", groups, f"at most {MAX_DESCRIBED_GROUPS} for a described problem")
    for name, flag in (("device_splits", device_splits), ("accumulate", accumulate), ("weight_list", weight_list)):
        if not isinstance(flag, bool):
            raise InvalidTypeError(name, flag, "True or False")
    _check_accumulate(op, accumulate)
    if recipe is None:
        resolved = plain_recipe_for(_dtype_name(dtype, "dtype") if dtype is not None else "bfloat16")
    else:
        resolved = get_recipe(recipe)
    info = described_device(device)
    if isinstance(splits, str):
        if splits not in ("balanced", "skewed"):
            raise InvalidArgumentError("splits", splits, "'balanced', 'skewed' or a list of group sizes")
        sizes = balanced_splits(groups, m) if splits == "balanced" else skewed_splits(groups, m)
    else:
        if not isinstance(splits, (list, tuple)):
            raise InvalidTypeError("splits", splits, "'balanced', 'skewed' or a list/tuple of group sizes")
        sizes = host_split_ints(splits, "splits")  # ints only: a float or None item is named
        if len(sizes) != groups or sum(sizes) != m or min(sizes) < 0:
            raise InvalidArgumentError("splits", splits, f"{groups} non-negative sizes summing to m={m}")
    in_dtype = _dtype_name(dtype, "dtype") if dtype is not None else (resolved.plain_dtype or "bfloat16")
    if resolved.plain_dtype is not None and in_dtype != resolved.plain_dtype:  # as a real call refuses it
        raise DTypeError("dtype", dtype, f"recipe {resolved.name} takes {resolved.plain_dtype} operands, or None")
    reg = registry()
    return build_problem(
        op=op,
        recipe=resolved,
        groups=groups,
        m=m,
        n=n,
        k=k,
        a_format=in_dtype,
        b_format=in_dtype,
        out_dtype=_dtype_name(out_dtype, "out_dtype") if out_dtype is not None else in_dtype,
        device=info,
        placement="cpu" if info.vendor == "cpu" else "cuda",
        splits=None if device_splits else sizes,
        m_align_cap=reg.max_m_multiple,
        weight_list=weight_list,
        accumulate=accumulate,
        contiguous=True,
        capturing=False,
    )


def _dtype_name(dtype: torch.dtype | str, argument: str) -> str:
    """A described operand or result dtype's name; anything else would describe a problem
    no call can make (``[int8 x int8 -> float64]``), which every backend then refuses."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    if name not in FLOAT_DTYPE_NAMES:
        raise DTypeError(argument, dtype, f"one of {', '.join(FLOAT_DTYPE_NAMES)} (a torch.dtype or its name)")
    return name


def explain(
    a: torch.Tensor | None = None,
    b: Any = None,
    m_splits: Any = None,
    *,
    op: Op = "fwd",
    recipe: str | Recipe | None = None,
    backend: Any = None,
    out: Any = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    **described: Any,
) -> Decision:
    """The full routing decision for a call, without running it.

    Pass the call's tensors (``explain(x, w, splits)``; for dgrad ``(dy, w, splits)``,
    for wgrad ``(dy, x, splits)``) or describe it with ``describe_problem``'s keywords
    (``groups=, m=, n=, k=, device="gfx950", splits="skewed"``...). Tensors are judged on
    the chip under them; a description on the described chip (``use_device``).
    """
    if a is not None:
        if described:
            raise InvalidArgumentError("explain", sorted(described), "tensors or a description, not both")
        _check_accumulate(op, accumulate)
        if op == "wgrad":
            call = validation.wgrad(a, b, m_splits, recipe, out, out_dtype, accumulate)
        elif op in OPS:
            call = validation.fwd_or_dgrad(op, a, b, m_splits, recipe, out, out_dtype)
        else:
            raise InvalidArgumentError("op", op, f"one of {', '.join(OPS)}")
        problem = call.problem()
    else:
        # A description has no tensors: a lone b, m_splits or out (a first operand left out)
        # would otherwise be dropped without a word.
        for name, value in (("b", b), ("m_splits", m_splits), ("out", out)):
            if value is not None:
                raise InvalidArgumentError(
                    name, value, "None without the first operand a: pass the call's tensors from a, or a description"
                )
        if not described:
            raise InvalidArgumentError(
                "explain", "no arguments", "the call's tensors (a, b, m_splits) or describe_problem's keywords"
            )
        problem = describe_problem(op=op, recipe=recipe, out_dtype=out_dtype, accumulate=accumulate, **described)
    decision, _ = decide(problem, call_order(backend))
    return decision


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """A registered backend as ``list_backends`` reports it.

    ``reasons_here`` says why it cannot run a representative problem (fwd, its first
    recipe, G=8, M=N=K=1024) on this machine; empty means it can. ``priority_here`` is
    its priority for that problem (a backend may rank itself per device: ``spec.priority``
    is only the default).
    """

    name: str
    plugin: str
    version: str
    spec: BackendSpec
    reasons_here: tuple[Reason, ...]
    priority_here: int

    @property
    def available(self) -> bool:
        return not self.reasons_here


def _probe(spec: BackendSpec, device: DeviceInfo) -> Problem:
    recipe = "bf16" if "bf16" in spec.recipes else sorted(spec.recipes)[0]
    op = "fwd" if "fwd" in spec.ops else sorted(spec.ops)[0]
    return describe_problem(op=op, groups=8, m=1024, n=1024, k=1024, recipe=recipe, device=device)


def list_backends(device: DeviceInfo | str | None = None) -> list[BackendInfo]:
    """Every registered backend, by name, with whether it can run here and why not."""
    info = described_device(device)
    out = []
    for entry in registry().entries():
        decision, _ = decide(_probe(entry.spec, info), config.parse_order([entry.spec.name]))
        out.append(
            BackendInfo(
                name=entry.spec.name,
                plugin=entry.plugin,
                version=entry.spec.version,
                spec=entry.spec,
                reasons_here=decision.candidate(entry.spec.name).reasons,
                priority_here=decision.candidate(entry.spec.name).priority,
            )
        )
    return out


def _check_order(order: config.OrderLike, argument: str) -> None:
    for _, names in config.parse_order(order, argument):
        check_names(names, registry(), argument)


def configure(**changes: Any) -> config.Settings:
    """Set process-wide options in code (they override the environment):
    ``backends`` (an order, None clears it), ``warn_fallback``, ``strict``, ``log_level``,
    ``check_device_splits``, ``debug`` (check that backends leave their inputs unmodified),
    ``autotune`` (time the eligible backends on a problem's first call instead of trusting
    declared priority). Flags take True / False only. Returns the settings now in force."""
    if changes.get("backends") is not None:
        _check_order(changes["backends"], "backends")
    return config.configure(**changes)


@contextlib.contextmanager
def use_backends(
    order: config.OrderLike | None = None,
    *,
    strict: bool | None = None,
    warn_fallback: bool | None = None,
    debug: bool | None = None,
    autotune: bool | None = None,
) -> Iterator[None]:
    """Prefer backends (and optionally set strict / fallback warnings / debug checks /
    autotune) inside a block.

    ``order`` is a name, a list of names, an order string (``"mxfp4:a,b;bf16:c"``) or a
    recipe -> names mapping. ``debug=True`` checks after every call that the backend did
    not modify its inputs in place. ``autotune=True`` ranks by measured time where no order
    applies (see ``configure``). Scopes nest and are local to the thread and asyncio task;
    leave one in the thread or task that entered it (elsewhere it stays on, with a warning).
    """
    if order is not None:
        _check_order(order, "order")
    with config.use_backends(order, strict=strict, warn_fallback=warn_fallback, debug=debug, autotune=autotune):
        yield


def register_backend(backend: BackendLike) -> None:
    """Register a backend object in code (its name must be new)."""
    registry().register(backend, plugin="code")


def unregister_backend(name: str) -> BackendLike:
    """Remove a backend by name; returns it."""
    return registry().unregister(name)


def plugin_failures() -> list[PluginFailure]:
    """Plugins that failed to import or register, with their errors."""
    return list(registry().failures)


def dispatch_stats() -> dict[str, Any]:
    """Calls per selected backend, fallbacks, skips per (backend, reason code), and
    ``autotune``: signatures tuned here / loaded from disk, calls made while measuring."""
    return DISPATCHER.stats()


def reset_dispatch_stats() -> None:
    """Zero the counters and forget which fallback warnings were already shown."""
    DISPATCHER.reset_stats()


def mark_updated(*weights: Any) -> None:
    """Declare an in-place write torch did not count (``torch.distributed`` collectives,
    writes through ``.data``, numpy / DLPack aliases, writes to inference tensors) to each
    of ``weights``: tensors, ``MXTensor``s, or lists / tuples of them. A write is declared on
    the tensor's memory, so one declared on a flat buffer covers every tensor on it. Whatever
    the library derived from them (a pre-quantized weight's kernel layout, a frozen layer's
    copy, ``gg.offsets``' ends) is rebuilt, or refused, on the next call
    (``grouped_gemm.updates``)."""
    count_writes(list(_written_tensors(weights, "weights")))


def _written_tensors(value: Any, argument: str) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, MXTensor):
        yield value.data
        yield value.scale
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _written_tensors(item, f"{argument}[{i}]")
    else:
        raise InvalidTypeError(argument, value, "a torch.Tensor, an MXTensor, or a list / tuple of them")
