"""``python -m torch_sagemaker.planner``: see ``torch_sagemaker.planner.cli``."""

import sys

from torch_sagemaker.planner.cli import main

sys.exit(main())
