"""What a run is, read by the trainer, the planner, `orz eval` and the Slurm launcher alike:
`placement` (its roles, their sizes, the engines, colocation: decided once), `role_spec` (the one
builder of a role's model spec), `resume` (where a run starts) and `run_rules` (every refusal that
relates several settings, a model or a machine, before a worker starts). Below the trainer's
package: nothing here imports orz/ppo/ or Ray; the environments' rules still read orz/rollout/envs.py.
"""
