"""Running a job unattended: the supervisor's state machine (`machine`), the processes it
starts (`local_job`), shrinking to fewer processes (`elastic`) and srun steps (`slurm_step`)."""
