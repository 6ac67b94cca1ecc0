"""The planner's validation: ``python -m benchmarks planner {memory,time,public}``.

The planner itself (``torch_sagemaker.planner``) is part of the library; measuring its
predictions against this machine spawns ranks and runs other benchmarks, so it lives here.
"""
