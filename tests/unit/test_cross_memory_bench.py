"""`python -m benchmarks cross_memory` prints its table with every way measured."""

import re
import sys

import pytest

from benchmarks import cross_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process_vm_readv is Linux's")
def test_cross_memory_prints_a_rate_for_each_way(capsys):
    assert cross_memory.main(["--mib", "4", "--pieces", "256K", "--repeat", "1"]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if re.match(r"\| (4 KiB|huge) ", line)
    ]
    assert len(rows) == 2, rows  # 4 KiB and huge pages, one piece size
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        rates = [float(c) for c in cells[2:5]]  # a child's error would leave text here
        assert all(r > 0 for r in rates), row
