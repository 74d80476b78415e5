"""What the core checks after a backend's ``run()``: the result against the Problem, and
(in debug mode) that the inputs were not modified in place.

A backend is third-party code; without these checks a wrong shape would be broadcast
into ``out=``, a float64 or ``None`` result handed to the caller, and an in-place edit of
``x`` would change the caller's tensor unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grouped_gemm.errors import BackendRunError
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.problem import Problem


class ContractViolation(Exception):
    """What a backend did against the contract (the cause of a BackendRunError)."""


def _operand_device(operand: Any) -> torch.device:
    return (operand[0] if isinstance(operand, list) else operand).device


def _tensor_problem(
    result: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, out: Any = None
) -> str | None:
    if not isinstance(result, torch.Tensor):
        return f"run() returned {type(result).__name__}, not a torch.Tensor"
    if result.is_nested or result.layout != torch.strided:  # a nested tensor's shape raises
        return f"run() returned a {'nested' if result.is_nested else result.layout} tensor; results are dense (strided)"
    if tuple(result.shape) != shape:
        return f"run() returned shape {tuple(result.shape)}, expected {shape}"
    if result.dtype != dtype:
        return f"run() returned dtype {result.dtype}, expected {dtype}"
    if result.device != device:
        return f"run() returned a tensor on {result.device}, expected {device}"
    if result.requires_grad and result is not out:  # the backend's graph would reach the caller's
        # (the caller's own out= may require grad: gg.backend.gmm's c, say)
        return "run() returned a tensor that requires grad; results of the functional GEMMs are plain tensors"
    return None


def checked_result(name: str, problem: Problem, inputs: GroupedInputs, result: Any) -> Any:
    """The value to hand the caller, or BackendRunError naming the backend.

    ``run()`` must return a tensor of the problem's result shape, ``out_dtype`` and the
    operands' device (wgrad into a list ``out``: G ``(N, K)`` tensors). Given ``out``, a
    backend returns it (required when accumulating); another result is copied into it.
    """
    out = inputs.out
    if result is None:
        return _raise(name, problem, "run() returned None; it must return the result (inputs.out when given)")
    dtype = problem.out_torch_dtype
    device = _operand_device(inputs.a)
    shape = problem.out_shape
    if isinstance(out, list):
        same = isinstance(result, (list, tuple)) and len(result) == len(out)
        if same and all(r is o for r, o in zip(result, out, strict=True)):
            return out
        if problem.accumulate:
            return _raise(name, problem, "with accumulate=True, run() must add into inputs.out and return it")
        items = list(result) if isinstance(result, (list, tuple)) else [result]
        if isinstance(result, torch.Tensor):
            issue = _tensor_problem(result, shape, dtype, device)
            items = list(result.unbind(0)) if issue is None else items
        else:
            issue = None if len(items) == len(out) else f"run() returned {len(items)} tensors, expected {len(out)}"
            for item in items:
                issue = issue or _tensor_problem(item, shape[1:], dtype, device)
        if issue:
            return _raise(name, problem, issue)
        _copy(name, problem, lambda: torch._foreach_copy_(out, items))
        return out
    issue = _tensor_problem(result, shape, dtype, device, out)
    if issue:
        return _raise(name, problem, issue)
    if out is not None and result is not out:
        if problem.accumulate:
            return _raise(name, problem, "with accumulate=True, run() must add into inputs.out and return it")
        _copy(name, problem, lambda: out.copy_(result))
        return out
    return result


def _copy(name: str, problem: Problem, copy: Callable[[], object]) -> None:
    """Copy a backend's result into ``out``: what torch refuses (a result that is a
    partially overlapping view of ``out``) is that backend's BackendRunError."""
    try:
        copy()
    except RuntimeError as exc:
        _raise(
            name, problem, f"run() returned a result that cannot be copied into inputs.out ({exc}); return inputs.out"
        )


def _raise(name: str, problem: Problem, message: str) -> Any:
    violation = ContractViolation(message)
    raise BackendRunError(name, problem, violation) from violation


def operand_tensors(operand: Any) -> list[torch.Tensor]:
    """The tensors behind an operand: itself, a list's items, an MXTensor's data and scales."""
    if isinstance(operand, torch.Tensor):
        return [operand]
    if isinstance(operand, (list, tuple)):
        return [t for item in operand for t in operand_tensors(item)]
    data, scale = getattr(operand, "data", None), getattr(operand, "scale", None)
    return [t for t in (data, scale) if isinstance(t, torch.Tensor)]


def _watched(inputs: GroupedInputs) -> list[tuple[str, torch.Tensor]]:
    named = [("a", t) for t in operand_tensors(inputs.a)] + [("b", t) for t in operand_tensors(inputs.b)]
    if isinstance(inputs.m_splits, torch.Tensor):
        named.append(("m_splits", inputs.m_splits))
    return named


def input_versions(inputs: GroupedInputs) -> list[int]:
    """Version counters of every input tensor (``out`` excluded: writing it is the job)."""
    return [t._version for _, t in _watched(inputs)]


def check_unmodified(name: str, problem: Problem, inputs: GroupedInputs, before: list[int]) -> None:
    """BackendRunError if ``run()`` modified an input tensor in place."""
    for (operand, tensor), version in zip(_watched(inputs), before, strict=True):
        if tensor._version != version:
            _raise(name, problem, f"run() modified its input {operand} in place (debug check)")
