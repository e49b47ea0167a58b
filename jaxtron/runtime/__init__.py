"""What a training process needs from its surroundings: joining a multi-process job
(`distributed`), signals (`preemption`), its run folder (`run_dir`), host memory and CPU matmul
settings, and the metrics, traces and plots it leaves."""
