"""cag's native kernels (kernels/decode_attention.cpp): decode attention on Intel AMX, and the step's
glue around the products (RMSNorm straight to bf16; rope with the K/V write), all in one library.

Why: a decode step's attention reads the whole prefix once per layer for a few query rows (a
request's heads that share a K/V head). torch's fused CPU kernel spends 12.5-14 ms doing that at 4K
tokens of SmolLM2 (94 MB of bf16 K/V that a plain read takes ~7 ms for), and cag's cascade around
it (the request's own suffix in a second call, the merge of the two, layout ops) another ~6.5 ms a
step. This kernel reads prefix and suffix in one call at near read speed, with AMX for the products
so that 16 requests on one prefix cost about what torch's kernel costs for them (bench_decode).

With it, a float32 step over packed products runs each layer's two RMSNorms and its rope + K/V write
as one call each (cag.step's `glue`): ~30 small torch ops a layer fewer, 3-4 ms a step here; the rope
gives the formula's bits, the norm its own (a row's bits its own).

How: compiled on first use for this machine (-march=native) with the C++ compiler torch's own
extensions use, against the installed torch, into ~/.cache/cag/kernels (key: source, torch
version, compiler, CPU flags), then loaded as torch.ops.cag.decode_attention. A build takes ~10 s
once per machine; concurrent first uses each build to a private name and the last rename wins.

CAG_DECODE_ATTENTION picks it: `auto` where it can run (a Linux x86-64 CPU with AMX-BF16 and a
compiler), else torch's kernel with one warning; `amx` refuses to start without it; `torch` never
uses it. The two give different last bits, so `cag` == `full` holds within one setting (both use
the same), as across CAG_WEIGHTS formats; snapshots (prefill) never depend on it.
"""

from __future__ import annotations

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

from .errors import ModelError

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "kernels" / "decode_attention.cpp"
MODES = ("auto", "amx", "torch")
ATTR = "cag_decode_attention"  # on a loaded model: what CAG_DECODE_ATTENTION resolved to ("amx" or "torch")
HEAD_DIMS = (64, 128)  # the head widths the kernel takes
FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f")
_lock = threading.Lock()
_state: dict = {}  # "fn": the loaded op, or "why": why it cannot run here (once per process)


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


def why_not() -> str | None:
    """None where the kernel can be built here, else why not (one line)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    missing = [f for f in FLAGS if f not in _cpu_flags()]
    if missing:
        return "this CPU lacks " + ", ".join(missing)
    if _compiler() is None:
        return "no C++ compiler found (install g++, or set CXX)"
    return None


def _build() -> Path:
    from torch.utils.cpp_extension import include_paths

    cxx, lib = _compiler(), Path(torch.__file__).parent / "lib"
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-ffp-contract=off",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, cxx, version, " ".join(flags),
                                    " ".join(sorted(_cpu_flags()))]).encode()).hexdigest()[:16]
    out = cache_dir() / f"decode_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}")
    log.warning("cag: building the AMX decode attention kernel for this machine (once, ~10 s)")
    cmd = [cxx, *flags, *(f"-I{p}" for p in include_paths()), str(SOURCE), "-o", str(tmp),
           f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:300])
            raise RuntimeError(f"{Path(cxx).name} failed: {first}")
        os.replace(tmp, out)  # appears whole or not at all
    finally:
        tmp.unlink(missing_ok=True)
    return out


def load() -> Callable | None:
    """torch.ops.cag.decode_attention, built and loaded once per process; None where it cannot run
    (the reason: `reason()`)."""
    with _lock:
        if not _state:
            why = why_not()
            if why is None:
                try:
                    torch.ops.load_library(str(_build()))
                    _state["fn"] = torch.ops.cag.decode_attention
                except Exception as e:  # a failed build or load: torch's kernel serves instead
                    why = f"it did not build or load: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            _state.setdefault("why", why)
        return _state.get("fn")


def reason() -> str | None:
    load()
    return _state.get("why")


def resolve(mode: str, device: torch.device | str = "cpu") -> str:
    """What CAG_DECODE_ATTENTION `mode` means here: "amx" or "torch". `amx` where it cannot run raises
    ModelError (one line); `auto` falls back to "torch" with one warning."""
    if mode not in MODES:
        raise ModelError(f"unknown decode attention {mode!r}; use one of {', '.join(MODES)}")
    if mode == "torch":
        return "torch"
    if torch.device(device).type != "cpu":
        if mode == "amx":
            raise ModelError(f"CAG_DECODE_ATTENTION=amx is a CPU kernel; on {torch.device(device).type} use auto or torch")
        return "torch"
    if load() is not None:
        return "amx"
    if mode == "amx":
        raise ModelError(f"CAG_DECODE_ATTENTION=amx cannot run here: {reason()}; use auto or torch")
    if not _state.get("warned"):
        _state["warned"] = True
        if why_not() is None:  # a machine that should have had it: say so; elsewhere torch's kernel is simply the one
            log.warning("cag: decode attention falls back to torch's kernel: %s", reason())
    return "torch"
