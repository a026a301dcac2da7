"""`python -m expgpu.report SWEEP_DIR`: the same as `expgpu-report SWEEP_DIR`."""

import sys

from expgpu.report import main

sys.exit(main(prog="python -m expgpu.report"))
