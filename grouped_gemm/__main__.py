"""``python -m grouped_gemm``: the ``grouped-gemm`` command line."""

import sys

from grouped_gemm.cli import main

sys.exit(main())
