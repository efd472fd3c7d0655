"""Issue #23 item 1 (memory): ``fix_mmap_threshold`` keeps glibc from serving a multi-MiB tensor out
of its heap (where a freed block stays resident) after a larger block was freed. Run in a child
process (the setting is per process); a control child without the fix shows the heap case."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refppo.dump.residency import _mallopt

_CHILD = """
import sys, torch
from refppo.dump.residency import fix_mmap_threshold
big = torch.ones(4 << 20)  # 16 MiB, mapped; freeing it raises glibc's dynamic threshold to 16 MiB
del big
if sys.argv[1] == "fix":
    fix_mmap_threshold()
x = torch.ones(3 << 19)  # 6 MiB
p = x.data_ptr()
heap = False
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        heap = heap or lo <= p < hi
print("heap" if heap else "mapped")
"""


@pytest.mark.skipif(_mallopt() is None or sys.platform != "linux", reason="glibc on Linux only")
def test_a_freed_large_block_does_not_move_later_tensors_into_the_heap() -> None:
    def run(arg: str) -> str:
        out = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert run("control") == "heap"  # glibc's default: the 6 MiB tensor comes from the heap
    assert run("fix") == "mapped"
