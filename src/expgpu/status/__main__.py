"""`python -m expgpu.status [DIR]`: the same as `expgpu status [DIR]`."""

import sys

from expgpu.status import main

sys.exit(main())
