"""Compatibility namespace: ``smdistributed.dataparallel``."""
