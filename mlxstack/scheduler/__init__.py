"""The scheduler: which requests advance in a step, and how (plain data in, a StepPlan out).

No MLX here (tests/test_layers.py checks it by importing every module in a fresh interpreter):
the engine core (engine/core.py) hands it what it needs to know of each request as numbers and
flags, it answers with a plan, and the core has the runner execute it.
"""
