"""The AVX2 library's tests on an AVX2-only CPU, whatever CPU runs the suite: tests/test_avx2_products.py under
bench/avx2_cpu.sh (qemu-user emulating an AMD EPYC Zen 3, /proc/cpuinfo without AVX-512). There the AVX-512 library
must not load, `auto` must pick the AVX2 library, and its products, attention and an engine on them (cag == full,
batched == alone) must pass, with no AVX-512 instruction anywhere it runs (qemu stops one with SIGILL). ~1 min;
skipped where qemu-user or a mount namespace is not at hand (.ci/run installs qemu-user)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "avx2_cpu.sh"


def _why_not() -> str | None:
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return "needs Linux on x86-64"
    if shutil.which("qemu-x86_64") is None:
        return "needs qemu-user (apt-get install qemu-user)"
    probe = subprocess.run(["bash", str(SCRIPT), "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"bench/avx2_cpu.sh cannot run here: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def test_the_avx2_tests_pass_on_an_emulated_zen3():
    if why := _why_not():
        pytest.skip(why)
    # one emulated process (torch's import alone takes ~40 s there): what it sees, then the AVX2 library's tests
    code = (
        "import sys, pytest, torch; from cag.kernels import native; "
        "print('seen', native.cpu_why_not() is not None, native.resolve('auto'), "
        "torch.backends.cpu.get_cpu_capability()); "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rs', 'tests/test_avx2_products.py']))"
    )
    run = subprocess.run(["bash", str(SCRIPT), sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    seen = next((line.split()[1:] for line in run.stdout.splitlines() if line.startswith("seen ")), None)
    assert seen == ["True", "avx2", "AVX2"], run.stdout  # below the AVX-512 floor; auto = the AVX2 library; torch too
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
    # the two tests that compare with the AVX-512 library skip there: it must not load on that CPU
    assert "the AVX-512 library does not run here" in run.stdout, tail
