"""``gg.balanced_splits`` / ``gg.skewed_splits``: their arguments are checked by name."""

from __future__ import annotations

import numpy as np
import pytest

import grouped_gemm as gg

# (function, args, error, message start); what each did before in the comment.
BAD = [
    (gg.balanced_splits, (0, 10), gg.InvalidArgumentError, "groups=0 is invalid: an int >= 1"),  # ZeroDivisionError
    (gg.balanced_splits, (-1, 10), gg.InvalidArgumentError, "groups=-1 is invalid"),  # IndexError
    (gg.balanced_splits, (2, -5), gg.InvalidArgumentError, "m=-5 is invalid: an int >= 0"),  # [-3, -2]
    (gg.balanced_splits, (3, 10.5), gg.InvalidTypeError, "m=10.5 is invalid"),  # [3.0, 3.0, 4.5]
    (gg.balanced_splits, (True, 10), gg.InvalidTypeError, "groups=True is invalid"),  # [10]
    (gg.skewed_splits, (0, 10), gg.InvalidArgumentError, "groups=0 is invalid"),  # IndexError
    (gg.skewed_splits, (3, -5), gg.InvalidArgumentError, "m=-5 is invalid: an int in [0, 2**53]"),  # [-2, -2, -1]
    (gg.skewed_splits, (3, 2**70), gg.InvalidArgumentError, "m=1180591620717411303424 is invalid"),  # OverflowError
    (gg.skewed_splits, (3.0, 10), gg.InvalidTypeError, "groups=3.0 is invalid"),  # torch's TypeError
    (gg.skewed_splits, (3, 10, None), gg.InvalidTypeError, "seed=None is invalid: an int in [-2**63"),  # RuntimeError
    (gg.skewed_splits, (3, 10, 2**64), gg.InvalidArgumentError, "seed=18446744073709551616 is invalid"),
]


@pytest.mark.parametrize(("function", "args", "error", "text"), BAD)
def test_bad_split_arguments_are_named(function, args, error, text):
    with pytest.raises(error) as info:
        function(*args)
    assert str(info.value).startswith(text)


def test_numpy_ints_give_python_int_splits():
    """numpy counts gave a list of numpy ints from balanced_splits."""
    balanced = gg.balanced_splits(np.int64(3), np.int64(10))
    assert balanced == [3, 3, 4] and all(type(s) is int for s in balanced)
    assert gg.skewed_splits(np.int32(5), np.int64(100), seed=np.int64(2)) == gg.skewed_splits(5, 100, seed=2)
    assert gg.skewed_splits(4, 0) == [0, 0, 0, 0] and gg.balanced_splits(4, 0) == [0, 0, 0, 0]
    big = gg.skewed_splits(8, 2**53, seed=1)
    assert sum(big) == 2**53 and min(big) >= 0
