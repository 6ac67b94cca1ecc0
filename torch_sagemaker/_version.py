"""Version of torch_sagemaker (read by setup.py without importing the package)."""

__version__ = "0.1.0"
