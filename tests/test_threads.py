"""cag.runtime.omp_pools: a thread that waits for the decode thread gives its OpenMP workers back."""

from __future__ import annotations

import platform
import threading

import pytest
import torch

from cag.runtime import omp_pools


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/maps")
def test_release_gives_back_a_threads_pool_and_is_harmless_without_one():
    if torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch runs no OpenMP pool here")
    x = torch.randn(512, 512)
    got = {}

    def work():
        got["before"] = (x @ x).sum()  # a parallel region: this thread now has a pool
        got["released"] = omp_pools.release()
        got["again"] = omp_pools.release()  # nothing left to give back
        got["after"] = (x @ x).sum()  # and a new pool when it computes again, same result

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert got["released"] and got["again"] and torch.equal(got["before"], got["after"])
