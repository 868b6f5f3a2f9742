"""The split optimizer: the HBM split between expert slots and KV blocks as a multiple-choice knapsack.

Runs inside the controller process; pure Python + numpy (+ cvxpy/HiGHS for the MILP, imported on use). Never
imports torch, runtime or agent. `solve(problem, solver=...)` is the entry point the loop uses.
"""
