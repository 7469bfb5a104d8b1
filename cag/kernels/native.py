"""cag's native CPU kernels for decode rows, all in one library: decode attention (on AMX tiles, or
by AVX512-BF16 dot products), int4 and bf16 weight products at the speed of reading the weights, and
the step's glue around them (RMSNorm straight to bf16; rope with the K/V write).

Why: a decode step reads every weight and the whole cache once, so its floor is the time of that
read. torch's kernels run well below it for one row (int4: the weights dequantized per row; flash
attention over bf16 keys; ~30 small ops a layer between them). These run near it: bench_decode
measures the step beside the read bound.

How: compiled on first use for this machine (-march=native; the AVX2 library for AVX2 only: ISA) with the system
C++ compiler, against the installed torch, into ~/.cache/cag/kernels ($XDG_CACHE_HOME/cag/kernels; key: sources, torch
version, compiler, CPU flags), then loaded as torch.ops.cag.*. A build takes seconds, once per machine;
concurrent first uses wait for one build (a lock file beside it). The library is loaded only once it
is trusted: the folder and the file owned by this user (or root) and writable by no one else, and
the file's sha256 equal to the digest written beside it (`.so.sha256`) when it was built. What fails
(a truncated or bit-flipped file would die in dlopen with SIGBUS or SIGILL, at every start) is built
again, to a temp name renamed into place; the trusted file is loaded through the descriptor it was
verified on. A folder others can write is made private and its libraries rebuilt; one another user
owns is refused (torch's kernels, with a warning). The floor is a Linux x86-64 CPU with AVX512-BF16
(Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later); the AMX attention is compiled
in where the CPU has AMX.

A CPU below that floor with AVX2, FMA and F16C gets cag's int4 and q8 products, decode attention and
step glue from a library of their own (arch/avx2/, built and trusted the same way: `load_avx2`,
torch.ops.cag_avx2.*; the glue and attention ops have the main library's signatures).

Where the sources live (as llama.cpp's ggml-cpu/arch/): one folder per instruction set under arch/, the same
file names for the same role in each (products.cpp, attention.cpp, attention_item.cpp, step.cpp, and
kernels.h, vec.h: what the folder's files share), and common/ for what every instruction set shares (the
ops' argument checks, an attention call's items and merge weights, the q8 product's op). A library is the
.cpp files of its folders (SOURCES: arch/avx512/ and arch/amx/, whose AMX attention item is compiled in where
the CPU has AMX tiles and to stubs elsewhere; AVX2_SOURCES: arch/avx2/), compiled with the kernels' root on
the include path; its cache key covers those files and every header under cag/kernels/ (HEADERS), by path
and content. A new instruction set is a folder here, a library entry below and a Backend in backends.py.

CAG_DECODE_KERNELS picks them: `auto` = avx512 where the library builds (on AMX CPUs too: its
attention decodes faster than the AMX one there, bench/bench_decode.py), avx2 below its floor where
the AVX2 library builds, else torch's kernels (with one warning, naming why,
on a CPU that could run either library: no compiler, a failed build, an unsafe cache folder; `/health` says
which kernels run and why: `summary`); `amx`,
`avx512` and `avx2` refuse to start where they cannot run, with the reason; `torch` never uses them. Kernels
give different last bits, so `cag` == `full` holds within one setting (both use the same), as across
CAG_WEIGHTS formats; snapshots (prefill) never depend on it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from cag.errors import ModelError
from cag.kernels.build_cache import (
    UnsafeCache,  # noqa: F401 (digest_path: tests)
    _open_trusted,
    _sha256_fd,
    _write_new,
    digest_path,
    private_folder,
    verify,
)

log = logging.getLogger(__name__)
KERNELS = Path(__file__).parent  # arch/<instruction set>/ and common/ below it; the compiler's include path


def _sources(*folders: str) -> tuple[Path, ...]:
    """The .cpp files of `folders` (under KERNELS), in path order: a library's translation units."""
    return tuple(sorted(f for folder in folders for f in (KERNELS / folder).glob("*.cpp")))


# The AVX-512 library: products, attention (AMX's item compiled in where the CPU has tiles), glue, all layers.
SOURCES = _sources("arch/avx512", "arch/amx")
# Every header of every folder, keyed with each library (a header edit rebuilds what may include it).
HEADERS = tuple(sorted(KERNELS.rglob("*.h")))
MODES = ("auto", "amx", "avx512", "avx2", "torch")
# a library of its own: int4 and q8 products, and the decode attention and glue of a step
AVX2_SOURCES = _sources("arch/avx2")
# What each library (by its torch.ops namespace) compiles and keys: its sources and every header.
LIBRARIES = {"cag": SOURCES + HEADERS, "cag_avx2": AVX2_SOURCES + HEADERS}
AVX2_FLAGS = ("avx2", "fma", "f16c")
# The instruction set each library is compiled for: the AVX-512 one for this CPU; the AVX2 one for exactly AVX2_FLAGS
# (tuned for this CPU), so that on an AVX-512 CPU it is the code an AVX2-only CPU runs, and no AVX-512 instruction the
# compiler would pick for -march=native there reaches a CPU without it (bench/avx2_cpu.sh runs it on an emulated one).
ISA = {"cag_kernels": ("-march=native",), "cag_avx2": ("-mavx2", "-mfma", "-mf16c", "-mtune=native")}
HEAD_DIMS = (64, 80, 96, 128, 256)  # the head widths the attention kernels take (common/attention_plan.h: head_dim_ok)
# and those whose int8 snapshot codes they read (common/attention_plan.h: int8_blocks): all of them, in the snapshot's
# blocks (store/kv_int8.py): of 32 along the head, or one a head of 80 (80 codes and one scale per key)
INT8_HEAD_DIMS = HEAD_DIMS
# the library's floor (every CPU with bf16 has VNNI)
FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
TILES = ("amx_tile", "amx_bf16")  # and the AMX attention's
_lock = threading.Lock()
_state: dict = {}  # "fn": the loaded op, or "why": why it cannot run here (once per process)
_avx2: dict = {}  # "ok": the AVX2 products are loaded, or "why" not


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cag" / "kernels"


def tiles() -> bool:
    """Whether this CPU has AMX tiles for bf16 (the library then holds the AMX attention too)."""
    return all(f in _cpu_flags() for f in TILES)


def cpu_why_not(flags: tuple[str, ...] = FLAGS) -> str | None:
    """None where this machine (OS, architecture, CPU `flags`) can run the library, else why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    missing = [f for f in flags if f not in _cpu_flags()]
    if missing:
        return "this CPU lacks " + ", ".join(missing)
    return None


def why_not() -> str | None:
    """None where the library can be built here, else why not (one line)."""
    return cpu_why_not() or _compiler_why_not()


def avx2_why_not() -> str | None:
    """None where the AVX2 products can be built here, else why not (one line)."""
    return cpu_why_not(AVX2_FLAGS) or _compiler_why_not()


def _compiler_why_not() -> str | None:
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found (install g++, or set CXX)"
    if shutil.which(cxx) is None:
        return f"no C++ compiler found: CXX={cxx!r} is not a program here (install g++, or set CXX to one)"
    return None


def build_key(sources: tuple[Path, ...], cxx: str, version: str, flags: list[str]) -> str:
    """The cache key of the library of `sources` (.cpp and .h, each by its path under KERNELS and its text),
    built by `cxx` (`version`: its --version) with `flags` against this torch for this CPU."""
    texts = [f"{f.relative_to(KERNELS)}\n{f.read_text()}" for f in sources]
    return hashlib.sha256("\n".join([*texts, torch.__version__, cxx, version, " ".join(flags),
                                      " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]


def _build(sources: tuple[Path, ...], stem: str) -> tuple[Path, int]:
    """The library of `sources` (.cpp compiled, .h only keyed) for this machine and a descriptor on it,
    verified (`verify`); built first when it is missing or not trusted."""
    from torch.utils.cpp_extension import include_paths

    cxx, lib = _compiler(), Path(torch.__file__).parent / "lib"
    assert cxx is not None  # load() builds only where _compiler_why_not() found one
    flags = ["-O3", *ISA[stem], "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-ffp-contract=off",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = build_key(sources, cxx, version, flags)
    folder = cache_dir()
    exposed = private_folder(folder)
    out = folder / f"{stem}-{key}.so"
    lock = os.open(folder / f".{out.stem}.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time: the others wait, then verify what it made
        fd, why = (None, "its folder was writable by other users") if exposed else verify(out)
        if fd is not None:
            return out, fd
        if why != "missing":
            log.warning("cag: the cached kernel library %s is not trusted (%s): building it again", out, why)
        for stale in (out, digest_path(out)):
            stale.unlink(missing_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}")
        log.warning("cag: building cag's decode kernels for this machine (once, a few seconds)")
        cmd = [
            cxx,
            *flags,
            f"-I{KERNELS}",
            *(f"-I{p}" for p in include_paths()),
            *(str(f) for f in sources if f.suffix == ".cpp"),
            "-o",
            str(tmp),
            f"-L{lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{lib}",
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:300])
                raise RuntimeError(f"{Path(cxx).name} failed: {first}")
            os.chmod(tmp, 0o755)  # whatever the umask: no one else may write it
            fd = _open_trusted(tmp)
            try:
                digest = _sha256_fd(fd)
            finally:
                os.close(fd)
            _write_new(digest_path(out), f"{digest}\n".encode())  # the digest first: a crash between the
            os.replace(tmp, out)  # two renames leaves a digest with no library, which is built again
        finally:
            tmp.unlink(missing_ok=True)
        fd, why = verify(out)
        if fd is None:
            raise RuntimeError(f"the library just built does not verify: {why}")
        return out, fd
    finally:
        os.close(lock)


def load() -> Callable | None:
    """The library, built and loaded once per process (its AMX attention op as a handle); None where
    it cannot run (the reason: `reason()`)."""
    with _lock:
        if not _state:
            path, why = _open(why_not(), LIBRARIES["cag"], "cag_kernels")
            if path is not None:
                _state["fn"], _state["path"] = torch.ops.cag.decode_attention, path
            _state["why"] = why
        return _state.get("fn")


def _open(why: str | None, sources: tuple[Path, ...], stem: str) -> tuple[Path | None, str | None]:
    """The library of `sources` built (`_build`) and loaded into torch.ops, or (None, why not): `why`
    already known, or the build or load failing (torch's kernels serve instead)."""
    if why is not None:
        return None, why
    try:
        path, fd = _build(sources, stem)
        try:  # the very file verified, whatever happens to its path meanwhile
            torch.ops.load_library(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return path, None
    except Exception as e:
        return None, f"it did not build or load: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def reason() -> str | None:
    load()
    return _state.get("why")


def load_avx2() -> bool:
    """cag's AVX2 library (torch.ops.cag_avx2: int4_mm, q8_mm, decode_attention and the glue), built and loaded once per
    process; False where they cannot run (the reason: `avx2_reason()`)."""
    with _lock:
        if not _avx2:
            _avx2["cpu_ok"] = cpu_why_not(AVX2_FLAGS) is None  # else the CPU is why, and nothing to warn about
            path, _avx2["why"] = _open(avx2_why_not(), LIBRARIES["cag_avx2"], "cag_avx2")
            _avx2["ok"], _avx2["path"] = path is not None, path
        return bool(_avx2.get("ok"))


def avx2_reason() -> str | None:
    load_avx2()
    return _avx2.get("why")


def avx2_failed() -> str | None:
    """Why cag's AVX2 library, once tried, does not run on a CPU that has what it needs (no compiler,
    a failed build, an unsafe cache folder); None where it runs, was never tried, or the CPU is why."""
    return _avx2.get("why") if _avx2.get("cpu_ok") and not _avx2.get("ok") else None


def below_floor(cpu: str) -> str:
    """Why decode runs on torch's kernels on a CPU below the AVX-512 floor (`cpu`: what it lacks): the
    AVX2 library's failure where it was tried on a CPU that could run it, with one warning (it was
    silent, and named the missing AVX-512 instead, while `auto` also fell from int4 to fp32 weights),
    else the CPU. The reason is shown by /health: no path or compiler output in it."""
    if why := avx2_failed():
        _fall_back(why)
        return f"cag's AVX2 kernels cannot run here: {_public(why)}"
    return f"cag's kernels cannot run here: {cpu}"


def _fall_back(why: str) -> None:
    """Say once per process that decode falls back to torch's kernels, and why (no compiler ...)."""
    if not _state.get("warned"):
        _state["warned"] = True
        log.warning("cag: decode falls back to torch's kernels (slower): %s", why)


def resolve(mode: str, device: torch.device | str = "cpu") -> str:
    """What CAG_DECODE_KERNELS `mode` means here: "amx", "avx512", "avx2" or "torch". `amx`, `avx512` or
    `avx2` where they cannot run raise ModelError (one line); `auto` is avx512 where the library runs,
    avx2 (the AVX2 library) on a CPU below its floor that has AVX2, else "torch", with one warning
    where a CPU that could run them cannot (no compiler, a failed build)."""
    if mode not in MODES:
        raise ModelError(f"unknown decode kernels {mode!r}; use one of {', '.join(MODES)}")
    if mode == "torch":
        return "torch"
    if torch.device(device).type != "cpu":
        if mode != "auto":
            raise ModelError(
                f"CAG_DECODE_KERNELS={mode} is for the CPU; on {torch.device(device).type} use auto or torch"
            )
        return "torch"
    if mode == "avx2":
        if load_avx2():
            return "avx2"
        raise ModelError(f"CAG_DECODE_KERNELS=avx2 cannot run here: {avx2_reason()}; use auto or torch")
    if load() is not None:
        if mode == "amx" and not tiles():
            raise ModelError(
                "CAG_DECODE_KERNELS=amx cannot run here: this CPU lacks "
                f"{', '.join(f for f in TILES if f not in _cpu_flags())}; use avx512 or auto"
            )
        return "avx512" if mode == "auto" else mode  # auto: avx512 decodes faster than amx on AMX CPUs too (README)
    if mode != "auto":
        raise ModelError(f"CAG_DECODE_KERNELS={mode} cannot run here: {reason()}; use auto or torch")
    if (cpu := cpu_why_not()) is not None:  # below the library's floor: the AVX2 library, else torch's
        if load_avx2():
            return "avx2"
        below_floor(cpu)  # warns where the AVX2 library could run here (no compiler ...)
    else:  # a CPU that could run them (no compiler, a failed build): say so, once
        _fall_back(reason() or "it did not load")
    return "torch"


def _public(why: str) -> str:
    """A build or load failure with no file path or compiler output in it."""
    if why.startswith("no C++ compiler"):
        return "no C++ compiler found (install g++, or set CXX)"
    return "it did not build or load (the server's log says why)"


def public_reason() -> str | None:
    """`reason()` with no file path or compiler output in it: for /health, which anyone may read."""
    why = reason()
    return why if why is None or cpu_why_not() is not None else _public(why)
