"""expgpu on SLURM through hydra-submitit-launcher (`hydra/launcher=slurm`), and its local twin.

- resources.py: tasks and GPUs per node from the launcher settings and the job's gpu_map, checked;
- cluster.py: before anything is submitted, sbatch/srun on PATH, the controller answering, the partition known;
- preview.py: the dry run: the sbatch script submitit would submit, and each job's rank -> GPU plan;
- launch.py: the launcher's launch(): the above, then submit (all jobs or none) and wait for the results;
- sweep_job.py: hydra/launcher=slurm_pool: the whole sweep as one SLURM job running gpu_pool inside, followed.

Inside a job nothing here runs: every srun task is a plain `expgpu` rank (expgpu.ranks.slurm).
"""

__all__ = ["cluster", "launch", "preview", "resources", "sweep_job"]
