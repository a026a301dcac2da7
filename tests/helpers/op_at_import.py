"""A task module that runs a large torch op when it is imported (a dataset built at module level)."""

import torch

TABLE = torch.ones(4000, 64) / 16.0   # past torch's grain size: a parallel op on more than one thread
