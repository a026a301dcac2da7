"""One rank of a 2-rank DDP run over gloo through expgpu.dist.process_group, ending the way
a plain script does: returning, so the interpreter shuts down (tests/test_teardown.py).

    python tests/teardown_probe.py RANK RUN_DIR [--no-drain]

--no-drain turns off dist._let_gloo_threads_finish, to see the abort it prevents.
"""

import sys
from pathlib import Path

import torch

from expgpu import dist
from expgpu.ranks import RankInfo


def main() -> None:
    rank, run_dir = int(sys.argv[1]), Path(sys.argv[2])
    if "--no-drain" in sys.argv:
        dist._let_gloo_threads_finish = lambda: None
    info = RankInfo(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0,
                    master_addr="127.0.0.1", master_port=0, source="local")
    torch.manual_seed(0)
    with dist.process_group(info, "gloo", 60, run_dir):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(20):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()


if __name__ == "__main__":
    main()
