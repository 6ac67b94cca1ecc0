"""The parallelism planner: SMP configurations for a model and a cluster, ranked.

Ranked by predicted step time, with each rank's predicted memory:

    python -m torch_sagemaker.planner config.json --seq-len 4096 --global-batch-tokens 4M
        --hosts 32 --instance p5.48xlarge

or from Python, ``torch_sagemaker.planner.plan(...)``. docs/planner.md says what it models,
what it leaves out, and how it was validated. Modules, one concern each: ``presets`` (known
accelerators and instances), ``inputs`` (cluster, workload, limits), ``model`` (the config
read on the meta device), ``candidates`` (enumeration; valid or invalid by the library's
own checks), ``shards`` (parameter, gradient and optimizer bytes), ``activations`` (saved
activations), ``memory`` (the per-rank estimate), ``comm`` (the collective cost model's
door), ``cost_model`` (the collectives' latency-bandwidth model), ``timing`` (step time),
``search`` (the ``plan`` API), ``report`` (table, JSON, SMP config, plot), ``cli``. Its
validation against measured runs is a benchmark (``python -m benchmarks planner``, in
``benchmarks/planner/`` of a checkout).

Nothing in the library's core imports this package.
"""

from torch_sagemaker.planner.candidates import Candidate
from torch_sagemaker.planner.inputs import Cluster, Limits, Workload
from torch_sagemaker.planner.model import ModelSpec, load_model
from torch_sagemaker.planner.presets import ACCELERATORS, INSTANCES, Accelerator
from torch_sagemaker.planner.search import Evaluated, Plan, plan, search

__all__ = [
    "ACCELERATORS",
    "INSTANCES",
    "Accelerator",
    "Candidate",
    "Cluster",
    "Evaluated",
    "Limits",
    "ModelSpec",
    "Plan",
    "Workload",
    "load_model",
    "plan",
    "search",
]
