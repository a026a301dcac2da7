"""Which device? This node's GPUs (inventory), a pure strategy that gives each local rank its GPU(s)
(plan -> NodePlan), and the small step that makes a plan real in one process (apply).

Importing this package never imports torch: apply() does, lazily, after CUDA_VISIBLE_DEVICES is set.
"""

from expgpu.gpus.apply import ISOLATIONS, apply, cuda_initialized, set_device_ordinal
from expgpu.gpus.inventory import Gpu, inventory, parse_visible_devices
from expgpu.gpus.strategies import STRATEGIES, NodePlan, plan

__all__ = ["Gpu", "inventory", "parse_visible_devices", "NodePlan", "plan", "STRATEGIES", "apply",
           "set_device_ordinal", "cuda_initialized", "ISOLATIONS"]
