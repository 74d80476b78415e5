"""``grouped-gemm bench``: every eligible backend against ``torch._grouped_mm`` on MoE shapes.

Modules, one job each: ``shapes`` (cases and splits), ``operands`` (rotated random
inputs), ``ceilings`` (measured roofline), ``timing`` (event / host medians),
``accuracy`` (sampled float64 check), ``peer`` (the direct ``torch._grouped_mm`` calls),
``runner`` (the sweep), ``report`` / ``plot`` (outputs), ``command`` (the CLI).
Nothing heavy is imported here, so ``grouped-gemm --help`` stays fast.
"""
