"""Helpers of examples/train.py, one concern per file: arguments, data, model, schedule,
metrics and checkpoints. Each file reads top to bottom."""
