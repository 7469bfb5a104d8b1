"""Faults around cag's native kernels (issue 29): a damaged or unsafe cached library is rebuilt, never
loaded (a truncated .so died in dlopen with SIGBUS, a bit-flipped one with SIGILL, at every start);
no compiler is said once, on stderr and in /health; HEAD /health answers like GET; bench_decode
without an fp32 row.

Each start runs in a subprocess with a private cache folder (XDG_CACHE_HOME), so a crash cannot kill
pytest and no test touches the user's cache. Rebuilds cost nothing: the "compiler" (CXX) is a script
that writes the library this machine already built (one real build per machine, shared with
tests/test_native.py) and counts its calls; what is tested is what cag.kernels.native does around it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cag.kernels import native
from tests.conftest import REPO

START = "from cag.kernels import native; print(native.resolve('auto')); print(native.reason())"


@pytest.fixture(scope="module")
def good_library() -> Path:
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    assert native.load() is not None, native.reason()
    return native._state["path"]


@pytest.fixture
def fake_cxx(tmp_path, good_library):
    """(env, cache folder, count of builds): a compiler that "builds" by copying the good library."""
    script = tmp_path / "fake-c++"
    log = tmp_path / "builds.log"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "fake c++ for the kernel-cache tests"; exit 0; fi
        echo build >> {log}
        while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
        cp {good_library} "$out"
        """))
    script.chmod(0o755)
    cache = tmp_path / "xdg"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "CXX": str(script)}
    return env, cache / "cag" / "kernels", lambda: len(log.read_text().splitlines()) if log.exists() else 0


def start(env: dict) -> subprocess.CompletedProcess:
    """A fresh process that resolves CAG_DECODE_KERNELS=auto, as `cag ask` and `cag serve` do at load."""
    return subprocess.run([sys.executable, "-c", START], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)


def the_library(folder: Path) -> Path:
    (lib,) = folder.glob("cag_kernels-*.so")
    return lib


def test_a_damaged_or_unsafe_cached_library_is_rebuilt_not_loaded(fake_cxx, good_library):
    env, folder, builds = fake_cxx
    r = start(env)
    assert r.returncode == 0 and r.stdout.split()[0] == "avx512", r.stderr
    assert builds() == 1
    lib = the_library(folder)
    assert native.digest_path(lib).read_text().strip() == "sha256:" + _sha256(good_library)
    assert lib.stat().st_mode & 0o022 == 0 and folder.stat().st_mode & 0o077 == 0

    r = start(env)  # intact: loaded as it is
    assert r.returncode == 0 and r.stdout.split()[0] == "avx512" and builds() == 1, r.stderr

    good = good_library.read_bytes()

    def truncate():
        lib.write_bytes(good[: len(good) // 3])

    def flip():
        data = bytearray(good)
        data[len(data) // 2] ^= 0x40  # one bit in the code
        lib.write_bytes(bytes(data))

    def garbage():
        lib.write_bytes(os.urandom(4096))

    def no_digest():
        native.digest_path(lib).unlink()

    def writable_by_others():
        lib.chmod(0o666)

    def folder_writable_by_others():
        folder.chmod(0o777)

    def a_link():
        other = folder.parent / "elsewhere.so"
        other.write_bytes(good)
        lib.unlink()
        lib.symlink_to(other)

    damages = [truncate, flip, garbage, no_digest, writable_by_others, folder_writable_by_others, a_link]
    if os.geteuid() == 0:  # only root can give a file away: one owned by another user is not loaded
        damages.append(lambda: os.chown(lib, 65534, 65534))
    for n, damage in enumerate(damages, start=2):
        damage()
        r = start(env)
        assert r.returncode == 0, (damage.__name__, r.returncode, r.stderr)  # no SIGBUS (-7), no SIGILL (-4)
        assert r.stdout.split()[0] == "avx512", (damage.__name__, r.stdout, r.stderr)
        assert builds() == n, (damage.__name__, r.stderr)
        assert "building it again" in r.stderr or "built again" in r.stderr, (damage.__name__, r.stderr)
        lib = the_library(folder)
        assert lib.read_bytes() == good and not lib.is_symlink(), damage.__name__
        assert lib.stat().st_mode & 0o022 == 0 and folder.stat().st_mode & 0o022 == 0, damage.__name__
        fd, why = native.verify(lib)
        assert why is None, (damage.__name__, why)
        os.close(fd)
    # no temp files
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a folder another user's")
def test_a_kernels_folder_of_another_user_is_refused(fake_cxx):
    env, folder, builds = fake_cxx
    folder.mkdir(parents=True)
    os.chown(folder, 65534, 65534)
    r = start(env)
    assert r.returncode == 0 and r.stdout.split()[0] == "torch", r.stderr
    assert builds() == 0 and "belongs to uid 65534" in r.stderr and "falls back to torch" in r.stderr


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_no_compiler_is_said_once_on_stderr(tmp_path):
    """No C++ compiler, CAG_DECODE_KERNELS=auto: torch's kernels, and one warning saying so (it was silent)."""
    if why := native.cpu_why_not():
        pytest.skip(f"this CPU would not run cag's kernels anyway: {why}")
    bare = tmp_path / "bin"  # a PATH with python and no c++ or g++, CXX unset: the probe of the issue
    bare.mkdir()
    # a script, not a symlink: a venv's python linked from elsewhere finds no pyvenv.cfg beside it (no torch)
    (bare / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bare / "python").chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k != "CXX"},
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "PATH": str(bare),
    }
    code = START + "; print(native.resolve('auto'))"
    r = subprocess.run(["python", "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[0] == "torch" and r.stdout.split()[-1] == "torch", r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "torch's kernels" in ln]
    assert len(lines) == 1 and "no C++ compiler found" in lines[0], r.stderr
    assert not (tmp_path / "xdg").exists() or not list((tmp_path / "xdg").rglob("*.so"))


def test_health_says_which_kernels_run_and_why(tiny64_model_dir, monkeypatch, tmp_path, caplog):
    """Without a compiler on a CPU that could run cag's kernels: /health says torch, and why. HEAD
    /health answers as GET does (load balancers probe with HEAD), with no body."""
    from fastapi.testclient import TestClient

    from cag.api.app import create_app
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setattr(native, "_state", {})  # a fresh process's view of the library
    monkeypatch.setattr(native, "cpu_why_not", lambda: None)  # a CPU that could run it, whatever this one is
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ or g++ on it
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")  # bf16 K/V, heads of 64: what cag's kernels would take
    engine = Engine(get_settings())
    with (
        caplog.at_level(logging.WARNING, logger="cag.kernels.native"),
        TestClient(create_app(engine=engine), base_url="http://localhost") as c,
    ):
        assert c.head("/health").status_code in (200, 503)
        r = c.get("/health")
        while r.status_code == 503 and r.json()["status"] == "loading":
            r = c.get("/health")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["decode_kernels"] == "torch", body
        assert "no C++ compiler found" in body["decode_kernels_reason"] and str(tmp_path) not in r.text, body
        h = c.head("/health")
        assert h.status_code == 200 and h.content == b""
        assert set(c.get("/openapi.json").json()["paths"]["/health"]) == {"get"}  # HEAD adds no operation
    assert "no C++ compiler found" in caplog.text and "falls back to torch" in caplog.text


def test_health_names_the_kernels_that_run(tiny_model_dir, monkeypatch):
    """The usual case: the setting and why (here CAG_WEIGHTS=fp32: float32 K/V, torch's kernels)."""
    from fastapi.testclient import TestClient

    from cag.api.app import create_app
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setattr(native, "cpu_why_not", lambda: None)  # a CPU that could run them, whatever this one is
    with TestClient(create_app(engine=Engine(get_settings())), base_url="http://localhost") as c:
        while (r := c.get("/health")).status_code == 503:
            pass
        body = r.json()
        assert body["decode_kernels"] == "torch", body
        assert (
            "bf16 K/V" in body["decode_kernels_reason"] and "heads of 16 in float32" in body["decode_kernels_reason"]
        ), body
        assert c.head("/health").status_code == 200


def test_a_cpu_that_cannot_run_the_kernels_is_the_reason_given_first(tiny_model_dir, monkeypatch):
    """On a CPU without AVX512-BF16 no setting brings cag's kernels: /health and `cag info` say that,
    not which K/V dtype they would need."""
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")  # the AVX2 products are int4's
    below = {native.FLAGS: "this CPU lacks avx512f, avx512_bf16", native.AVX2_FLAGS: None}  # an AVX2-only CPU
    monkeypatch.setattr(native, "cpu_why_not", lambda flags=native.FLAGS: below[flags])
    lm = Engine(get_settings()).lm
    assert (lm.kernels, lm.kernels_why) == (
        "torch",
        "cag's kernels cannot run here: this CPU lacks avx512f, avx512_bf16",
    )
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setattr(native, "_avx2", {"why": "this CPU lacks avx2"})  # nor the AVX2 products
    lm = Engine(get_settings()).lm
    assert (lm.kernels, lm.kernels_why) == (
        "torch",
        "cag's kernels cannot run here: this CPU lacks avx512f, avx512_bf16",
    )


def test_a_cpu_below_the_avx512_floor_with_avx2_gets_the_avx2_products_for_int4(tiny_model_dir, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.errors import ModelError

    if why := native.avx2_why_not():
        pytest.skip(f"cag's AVX2 products cannot run here: {why}")
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    below = {native.FLAGS: "this CPU lacks avx512f, avx512_bf16", native.AVX2_FLAGS: None}  # an AVX2-only CPU
    monkeypatch.setattr(native, "cpu_why_not", lambda flags=native.FLAGS: below[flags])
    lm = Engine(get_settings()).lm
    assert (lm.kernels, lm.kernels_why) == (
        "avx2",
        "cag's AVX2 kernels run on this CPU; all layers in one call need AVX512-BF16: this CPU lacks avx512f, "
        "avx512_bf16",
    )
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx2")
    with pytest.raises(
        ModelError, match="CAG_DECODE_KERNELS=avx2 multiplies int4 weights; with CAG_WEIGHTS=fp32 use auto or torch"
    ):
        _ = Engine(get_settings()).lm


def test_bench_decode_table_without_fp32():
    """`bench_decode --formats int4` (no fp32 row to compare with) ended in StopIteration."""
    from bench.bench_decode import vs_fp32

    rows = [
        {"n_tokens": 100, "weights": "int4", "decode_tok_s": 50.0},
        {"n_tokens": 100, "weights": "bf16", "decode_tok_s": 40.0},
    ]
    vs_fp32(rows)
    assert [r["vs_fp32"] for r in rows] == [None, None]
    rows.append({"n_tokens": 100, "weights": "fp32", "decode_tok_s": 20.0})
    vs_fp32(rows)
    assert [r["vs_fp32"] for r in rows] == [2.5, 2.0, 1.0]


def _included(source: Path) -> set[Path]:
    """The files `source` includes with quotes, and theirs (as the compiler finds them: beside the including
    file, else under cag/kernels/, the -I of native._build)."""
    import re

    found: set[Path] = set()
    todo = [source]
    while todo:
        f = todo.pop()
        for name in re.findall(r'^\s*#include\s+"([^"]+)"', f.read_text(), re.M):
            dep = next((p for p in (f.parent / name, native.KERNELS / name) if p.is_file()), None)
            assert dep is not None, f"{f}: #include {name!r} is not under cag/kernels"
            dep = dep.resolve()
            if dep not in found:
                found.add(dep)
                todo.append(dep)
    return found


def test_a_library_is_built_again_when_any_file_it_compiles_changes():
    """A stale library after an edit would run the old kernels: each library's cache key reads every .cpp it
    compiles and every header they include (transitively), by path and text, and each backend names the
    sources its library compiles."""
    from cag.kernels import backends

    for namespace, files in native.LIBRARIES.items():
        keyed = {f.resolve() for f in files}
        cpp = {f for f in keyed if f.suffix == ".cpp"}
        assert cpp, namespace
        for f in cpp:
            assert _included(f) <= keyed, (namespace, f, sorted(map(str, _included(f) - keyed)))
        for b in backends.BY_NAME.values():
            if b.library == namespace:
                assert {f.resolve() for f in b.sources} == cpp, (b.name, namespace)
    on_disk = {f.resolve() for f in native.KERNELS.rglob("*") if f.suffix in (".cpp", ".h")}
    assert on_disk == {f.resolve() for files in native.LIBRARIES.values() for f in files}, (
        "a kernel file no library builds"
    )
    h = native.KERNELS / "common" / "attention_plan.h"
    key = native.build_key(native.LIBRARIES["cag"], "c++", "v", ["-O3"])
    assert key == native.build_key(native.LIBRARIES["cag"], "c++", "v", ["-O3"])
    assert key != native.build_key(tuple(f for f in native.LIBRARIES["cag"] if f != h), "c++", "v", ["-O3"])


def test_no_file_of_cag_is_over_350_lines():
    """Files of one idea (issue 52): the package's modules and the kernels by instruction set (arch/<isa>/), split
    by role, each at most 350 lines."""
    cag = native.KERNELS.parent
    long = {str(f.relative_to(cag)): n for f in cag.rglob("*")
            if f.suffix in (".cpp", ".h", ".py") and (n := len(f.read_text().splitlines())) > 350}
    assert not long, long
