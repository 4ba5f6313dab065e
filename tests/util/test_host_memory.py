"""util/host_memory.py: glibc keeps a CPU step's freed memory for the next step, unless someone chose otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accel_ddp.util.host_memory import keep_freed_host_memory, why_left_alone
from tests.helpers.host_memory import GLIBC, PAGES
from tests.helpers.runs import REPO

PROBE = """
import json, sys
from accel_ddp.util.host_memory import keep_freed_host_memory
from tests.helpers.host_memory import faults_per_step
done = keep_freed_host_memory() if sys.argv[1] == "pin" else "untouched"
print(json.dumps([done, faults_per_step()]))
"""


def probe(mode: str, **env: str) -> tuple[str, list[int]]:
    """(what keep_freed_host_memory did, page faults per step) in a fresh interpreter: the thresholds are global."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES",
                                                                                             "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**clean, "PYTHONPATH": str(REPO), **env}).stdout
    done, faults = json.loads(out)
    return done, faults


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc thresholds only")
def test_pinned_thresholds_reuse_a_steps_freed_memory_where_glibc_alone_faults_it_in_again():
    _, untouched = probe("default")
    if min(untouched[1:]) < PAGES // 2:
        pytest.skip(f"this glibc reuses the memory by itself (faults per step {untouched}): nothing to show")
    done, pinned = probe("pin")
    assert done == "pinned"
    assert pinned[0] >= PAGES // 2  # the first step maps its memory once
    assert max(pinned[1:]) < PAGES // 20, f"faults per step after the first: {pinned[1:]} (glibc alone: {untouched})"


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc thresholds only")
def test_a_users_own_malloc_settings_are_left_alone():
    done, faults = probe("pin", MALLOC_TRIM_THRESHOLD_="131072")
    assert done == "set in the environment"
    assert min(faults[1:]) >= PAGES // 2  # the user's small trim threshold still gives the memory back
    assert why_left_alone({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == "set in the environment"
    assert why_left_alone({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}) is None
    assert why_left_alone({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == \
        "another allocator is preloaded"
    assert keep_freed_host_memory({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}) == "another allocator is preloaded"
    assert why_left_alone({}) is None
