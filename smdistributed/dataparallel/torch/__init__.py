"""Compatibility namespace: ``smdistributed.dataparallel.torch``."""
