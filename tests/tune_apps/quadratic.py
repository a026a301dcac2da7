"""A plain Hydra app (nothing of expgpu's): its return value is what an optimizing sweeper minimizes.
Its minimum, 0, is at x=1, y=0, z=0 (w=0 when a custom search space adds it)."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="conf", config_name="quadratic")
def quadratic(cfg: DictConfig) -> float:
    if cfg.fail or cfg.x in cfg.fail_at:
        raise RuntimeError(f"asked to fail at x={cfg.x}")
    value = (cfg.x - 1) ** 2 + cfg.y ** 2 + cfg.z ** 2 + cfg.get("w", 0) ** 2
    if cfg.x in cfg.nan_at:   # a run that diverged
        value = float("nan")
    if cfg.returns == "dict":
        return {"loss": value, "size": abs(cfg.x) + abs(cfg.y)}
    return value


def near_x(cfg: DictConfig, trial) -> None:
    """custom_search_space: z close to the x already sampled, and w, which the config does not have."""
    x = trial.params["x"]
    trial.suggest_float("z", x - cfg.max_gap, x + cfg.max_gap)
    trial.suggest_float("+w", 0.0, 1.0)


if __name__ == "__main__":
    quadratic()
