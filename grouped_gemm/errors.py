"""Exception hierarchy.

Every error raised for a bad argument names the argument, the value it got and what is
allowed, and subclasses ``ValueError`` or ``TypeError`` so generic handlers still work.
"""

from __future__ import annotations

from typing import Any


def _rebuilt(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    """An error unpickled without calling its ``__init__`` (``BaseException.__new__`` takes
    any arguments), then given its attributes back."""
    error = cls.__new__(cls, *args)
    error.__dict__.update(state)
    return error


class GroupedGemmError(Exception):
    """Base class of every error this library raises on purpose."""

    def __reduce__(self) -> tuple:
        # BaseException's reduce calls cls(*self.args): (message,) where __init__ takes
        # (argument, value, allowed), so unpickling raised TypeError. A worker's error then
        # broke a ProcessPoolExecutor ("terminated abruptly") and hung multiprocessing.Pool.
        return _rebuilt, (type(self), self.args, self.__dict__)


class _NamedArgumentError(GroupedGemmError):
    """What an argument error carries: the argument's name, its value and what is allowed."""

    def __init__(self, argument: str, value: Any, allowed: str) -> None:
        self.argument = argument
        self.value = value
        self.allowed = allowed
        # Not super().__init__(message): torch.compile(fullgraph=True) cannot trace that call
        # and reported it ("Attempted to call a super() attribute") in place of this error.
        self.args = (f"{argument}={_short(value)} is invalid: {allowed}",)


class InvalidArgumentError(_NamedArgumentError, ValueError):
    """An argument has a value outside what is allowed."""


class InvalidTypeError(_NamedArgumentError, TypeError):
    """An argument has a type (or tensor dtype) outside what is allowed."""


class SplitsError(InvalidArgumentError):
    """``m_splits`` is inconsistent: negative, wrong length, wrong sum or not integers."""


class ShapeError(InvalidArgumentError):
    """A tensor has the wrong number of dimensions or a size that disagrees with another."""


class DTypeError(InvalidTypeError):
    """A tensor's dtype is not allowed, or disagrees with another operand's."""


class DeviceMismatchError(InvalidArgumentError):
    """Operands live on different devices."""


class UnknownRecipeError(InvalidArgumentError):
    """A recipe name that is not defined."""


class UnknownBackendError(InvalidArgumentError):
    """A backend name that no registered backend has."""


class ConfigError(InvalidArgumentError):
    """An invalid configuration value, from code or from an environment variable."""


class DuplicateBackendError(GroupedGemmError, ValueError):
    """Two backends tried to register under one name."""


class BackendUnavailableError(GroupedGemmError, RuntimeError):
    """No backend may run the problem (or, in strict mode, a named one may not).

    The message lists every backend considered and why it was skipped; ``decision`` holds
    the full :class:`~grouped_gemm.decision.Decision`.
    """

    def __init__(self, message: str, decision: Any = None) -> None:
        self.decision = decision
        super().__init__(message)


class BackendRunError(GroupedGemmError, RuntimeError):
    """A backend raised while running an eligible problem.

    The dispatcher never falls back after a failure (an asynchronous device error would
    make a retry unsafe, and a fallback would hide the bug); it re-raises the original
    exception as ``__cause__`` with the backend's name and the problem in the message.
    """

    def __init__(self, backend: str, problem: Any, cause: BaseException) -> None:
        self.backend = backend
        self.problem = problem
        super().__init__(f"backend '{backend}' failed on {problem}: {type(cause).__name__}: {cause}")


def _short(value: Any, limit: int = 120) -> str:
    """A repr that stays readable for long lists and tensors."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            # A nested tensor's .shape raises (jagged ones have none of ints): say what it is.
            shape = "nested" if value.is_nested else f"shape={tuple(value.shape)}"
            return f"Tensor({shape}, dtype={value.dtype}, device={value.device})"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
