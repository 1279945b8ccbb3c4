"""What a run is, read by the trainer, the planner, `orz eval` and the Slurm launcher alike:
`placement` (its roles, their sizes, the engines, colocation: decided once) and `run_rules`
(every refusal before a worker starts). Below the trainer's package: nothing here imports Ray."""
