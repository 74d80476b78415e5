"""grouped_gemm: one call for MoE grouped GEMMs, routed to the best backend that can run it.

import grouped_gemm as gg
out = gg.grouped_gemm(x, w, m_splits)          # fwd:   out_g = x_g @ w_g.T
dx = gg.grouped_gemm_dgrad(dy, w, m_splits)    # dgrad: dx_g  = dy_g @ w_g
dw = gg.grouped_gemm_wgrad(dy, x, m_splits)    # wgrad: dw_g  = dy_g.T @ x_g
print(gg.explain(x, w, m_splits))              # which backend, and why not the others
"""

from grouped_gemm import name_clash, ops
from grouped_gemm.api import (
    BackendInfo,
    configure,
    describe_problem,
    dispatch_stats,
    explain,
    grouped_gemm,
    grouped_gemm_dgrad,
    grouped_gemm_wgrad,
    list_backends,
    mark_updated,
    plugin_failures,
    register_backend,
    reset_dispatch_stats,
    unregister_backend,
    use_backends,
)
from grouped_gemm.autograd import grouped_linear
from grouped_gemm.config import Settings, reset_config, settings
from grouped_gemm.contract import Backend, BackendSpec, Reason
from grouped_gemm.decision import Candidate, Decision
from grouped_gemm.device import DeviceInfo, use_device
from grouped_gemm.dispatch import FallbackWarning
from grouped_gemm.errors import (
    BackendRunError,
    BackendUnavailableError,
    ConfigError,
    DeviceMismatchError,
    DTypeError,
    DuplicateBackendError,
    GroupedGemmError,
    InvalidArgumentError,
    InvalidTypeError,
    ShapeError,
    SplitsError,
    UnknownBackendError,
    UnknownRecipeError,
)
from grouped_gemm.group_offsets import GroupOffsets, offsets
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import MXRows, MXTensor, quantize_mx, quantize_mx_rows, quantize_mx_weight
from grouped_gemm.nn import GroupedLinear
from grouped_gemm.plugins import hookimpl
from grouped_gemm.problem import Problem
from grouped_gemm.recipes import RECIPES, Recipe, get_recipe
from grouped_gemm.splits import balanced_splits, skewed_splits

__version__ = "0.1.0"

name_clash.warn_if_clashing()

__all__ = [
    "RECIPES",
    "Backend",
    "BackendInfo",
    "BackendRunError",
    "BackendSpec",
    "BackendUnavailableError",
    "Candidate",
    "ConfigError",
    "DTypeError",
    "Decision",
    "DeviceInfo",
    "DeviceMismatchError",
    "DuplicateBackendError",
    "FallbackWarning",
    "GroupOffsets",
    "GroupedGemmError",
    "GroupedInputs",
    "GroupedLinear",
    "InvalidArgumentError",
    "InvalidTypeError",
    "MXRows",
    "MXTensor",
    "Problem",
    "Reason",
    "Recipe",
    "Settings",
    "ShapeError",
    "SplitsError",
    "UnknownBackendError",
    "UnknownRecipeError",
    "balanced_splits",
    "configure",
    "describe_problem",
    "dispatch_stats",
    "explain",
    "get_recipe",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
    "grouped_linear",
    "hookimpl",
    "list_backends",
    "mark_updated",
    "offsets",
    "ops",
    "plugin_failures",
    "quantize_mx",
    "quantize_mx_rows",
    "quantize_mx_weight",
    "register_backend",
    "reset_config",
    "reset_dispatch_stats",
    "settings",
    "skewed_splits",
    "unregister_backend",
    "use_backends",
    "use_device",
]
