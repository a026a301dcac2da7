"""The PYTHONPATH of the launches a benchmark starts: its own folders first, then the caller's (where
expgpu's dependencies may come from, as on a GPU node with them unpacked to a folder: gpu_session.sh)."""

import os


def pythonpath(*first) -> str:
    return os.pathsep.join([*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])])
