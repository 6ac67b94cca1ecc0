"""Lab tools run from a checkout (not installed): ``python -m tools.<name>``.

The simulated hosts (``netns``), the local S3 server (``moto_server``) and the peers the
benchmarks measure against (``bare_tcp``, ``deepspeed_peer``) are fixtures that tests and
``benchmarks/`` share; ``model_coverage`` runs tensor parallelism over transformers' families.
"""
