"""Compatibility namespace for scripts written against SageMaker's SMDDP (smdistributed)."""
