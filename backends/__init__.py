"""Built-in backends, importable as ``grouped_gemm.backends.<name>``.

Each module is a pluggy plugin listed in ``grouped_gemm.plugins.DEFAULT_PLUGINS``; it
imports the core and never another backend.
"""
