"""What this CPU runs, for the tests that need more than AVX2: the suite passes on AVX2-only, AVX-512
and AMX CPUs, each test of a format or kernel the CPU lacks skipped by name."""

from __future__ import annotations

import pytest

from cag.model.layouts import bf16_packs

needs_bf16 = pytest.mark.skipif(
    not bf16_packs(), reason="CAG_WEIGHTS=bf16 needs oneDNN's bf16 products (AVX-512 or AVX-NE-CONVERT)"
)


def formats(*params):
    """parametrize values with every one that names the bf16 weights format marked `needs_bf16`
    (a value, or a tuple holding "bf16")."""
    out = []
    for p in params:
        values = p if isinstance(p, tuple) else (p,)
        out.append(pytest.param(*values, marks=needs_bf16) if "bf16" in values else p)
    return out
