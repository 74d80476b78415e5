"""Nested scopes kept as a stack in a ``ContextVar`` (``use_backends``, ``use_device``).

Why not ``ContextVar.set`` / ``reset(token)``: reset returns the stack to what it was at
entry, so a scope exited out of order (a generator's scope closed after its caller's, an
``ExitStack`` misused) brings back scopes already exited, and every later call in that
thread or task is ruled by them. Here a scope removes only its own frame, by identity.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def pushed(stack: contextvars.ContextVar[tuple[Any, ...]], frame: Any) -> Iterator[None]:
    """``frame`` on top of ``stack`` inside the block; on exit that frame alone is removed.
    Frames are told apart by identity, so each scope needs an object of its own."""
    stack.set((*stack.get(), frame))
    try:
        yield
    finally:
        frames = stack.get()
        if any(f is frame for f in frames):
            stack.set(tuple(f for f in frames if f is not frame))
        else:
            # Left in another context than it was entered in (a generator holding the scope
            # finished in another thread or task): that context's stack cannot be reached
            # from here, so the scope stays on there; say so rather than nothing.
            warnings.warn(
                f"grouped_gemm: a scope ({stack.name}) was left in another thread or asyncio task "
                "than the one that entered it (e.g. a generator holding it was finished there); "
                "it stays active where it was entered. Enter and leave a scope in one thread or task.",
                RuntimeWarning,
                stacklevel=3,
            )
