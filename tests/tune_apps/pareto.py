"""A plain Hydra app with two objectives: near (0, 0) and near (2, 2) cannot both be small."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="pareto")
def pareto(cfg: DictConfig) -> tuple:
    return cfg.x ** 2 + cfg.y ** 2, (cfg.x - 2) ** 2 + (cfg.y - 2) ** 2


if __name__ == "__main__":
    pareto()
