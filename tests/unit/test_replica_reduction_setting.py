"""``TSM_OVERLAP_REPLICA_REDUCTION``: when tsm.init's FSDP1 patch defers replicas' all-reduce."""

import pytest

from torch_sagemaker.config import ConfigError
from torch_sagemaker.sharding.fsdp1_replicas import wanted


@pytest.mark.parametrize(
    ("value", "several_hosts", "expected"),
    [
        (None, True, True),  # unset: during backward across hosts
        (None, False, False),  # unset: one host keeps the synchronous call
        ("", True, True),
        ("0", True, False),
        ("1", False, True),
        (" 1 ", False, True),
    ],
)
def test_wanted(value, several_hosts, expected):
    environ = {} if value is None else {"TSM_OVERLAP_REPLICA_REDUCTION": value}
    assert wanted(several_hosts, environ) is expected


def test_other_values_name_the_variable_and_the_choices():
    with pytest.raises(ConfigError) as raised:
        wanted(True, {"TSM_OVERLAP_REPLICA_REDUCTION": "yes"})
    message = str(raised.value)
    assert "TSM_OVERLAP_REPLICA_REDUCTION='yes'" in message
    assert "expected 0" in message and "or 1" in message
