"""What the staging tests share: staged and plain smddp groups, their trace, distinct data.

``stage_cpu=True`` sends CPU tensors through smddp's device staging path (Note [Device
staging] in csrc/smddp/backend/device_staging.h); ``tests/distributed/test_smddp_staging.py``
and ``test_smddp_staging_timeline.py`` use these helpers in their ranks.
"""

CHUNK = 4096  # bytes: the smallest staging_chunk_bytes


def staged_and_plain_groups():
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    ranks = list(range(dist.get_world_size()))
    staged = dist.new_group(
        ranks,
        backend="smddp",
        pg_options=SMDDPOptions(stage_cpu=True, staging_chunk_bytes=CHUNK),
    )
    plain = dist.new_group(ranks, backend="smddp")
    return staged, plain


def staging_trace(group):
    import torch

    return list(group._get_backend(torch.device("cpu"))._staging_trace())


def distinct_data(n, dtype, rank, salt=0):
    """Distinct values per element and rank (misplaced chunks change the result)."""
    import torch

    i = torch.arange(n, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i * 7 + rank + salt) % 3) == 0
    v = (i * 31 + rank * 17 + salt) % 23 - (0 if dtype == torch.uint8 else 11)
    if dtype.is_floating_point:
        return (v.to(torch.float64) / 4 + 0.5).to(dtype)
    return v.to(dtype)
