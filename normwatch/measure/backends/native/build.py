"""Building and loading the native backend: one builder for the C library (the readers,
the folds, the update sample: ``rows.c``, ``folds.c``, ``sample.c``) and the C++ module
(the hooks' lanes: ``lane.cpp``, ``grads.cpp``, ``sampler.cpp``).

    >>> library()        # the C library (ctypes), built at first use; None where it cannot be
    >>> lane_module()    # the C++ module's path, built at first use (raises where it cannot)

Both are compiled at first use with the system's compilers into a per-user cache
(``$NORMWATCH_CACHE``, else ``$XDG_CACHE_HOME/normwatch`` or ``~/.cache/normwatch``,
private to the user), named by a hash of the sources, the compiler, the flags and what
they link to, side by side (each source on a core of its own), then renamed into place
in one step. The C library is built with OpenMP and linked to torch's own runtime where
torch runs on GNU OpenMP (:func:`openmp_runtime`: its parallel regions then use torch's
threads), else single-threaded. ``NORMWATCH_NATIVE=0`` never builds either.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from normwatch.pipeline import BUILD_LOG

HERE = Path(__file__).parent
C_SOURCES = (HERE / "rows.c", HERE / "grads.c", HERE / "sample.c", HERE / "folds.c")
"""The C library's sources: a call's rows, a gradient's, the update sample, the folds
(and ``native.h``, which they share)."""
C_HEADERS = (HERE / "native.h",)
CPP_SOURCES = tuple(HERE / name for name in ("lane.cpp", "common.cpp", "grads.cpp",
                                             "gradreads.cpp", "sampler.cpp"))
"""The C++ module's sources: the forward lane, what the lanes share, the gradient hooks
and their reads, the update monitor's step hooks."""
CPP_HEADERS = (HERE / "lane.h", HERE / "grads.h")
NAME = "normwatch_lane"
"""The C++ module's name."""

log = logging.getLogger(BUILD_LOG)


def cache_dir() -> Path:
    """Where the compiled library is kept (made private to this user)."""
    root = os.environ.get("NORMWATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "normwatch")
    return Path(root)


def compiler(variable: str, names: tuple[str, ...], language: str) -> tuple[str, str]:
    """The compiler ``$variable`` names, else the first of ``names`` on PATH, and what its
    ``--version`` says (``RuntimeError``: none)."""
    found = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if found is None:
        raise RuntimeError(f"no {language} compiler ({', '.join(names)}) on PATH")
    return found, subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout


def built(name: str, sources: Sequence[Path], salt: str,
          make: Callable[[Path, Path], None]) -> Path:
    """The cached file ``name`` (``{key}`` in it: a hash of ``sources`` and ``salt``),
    made where missing by ``make(folder, target)`` in a fresh folder of the cache, then
    renamed into place (a half-made file is never seen, two builders never collide)."""
    key = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + salt.encode()
                         ).hexdigest()[:16]
    folder = cache_dir()
    target = folder / name.format(key=key)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        made = Path(tmp) / target.name
        make(Path(tmp), made)
        os.replace(made, target)
    return target


def run(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side; a failure raises ``RuntimeError`` with the
    compiler's words (and leaves no compiler writing)."""
    running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True) for c in commands]
    try:
        for command, process in zip(commands, running, strict=True):
            _, err = process.communicate(timeout=600)
            if process.returncode:
                raise RuntimeError(f"{' '.join(command[-3:])} did not build: {err[-2000:]}")
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()


def _compiled(compiler: str, flags: list[str], sources: Sequence[Path], folder: Path
              ) -> list[Path]:
    """``sources`` compiled side by side into object files in ``folder``."""
    objects = [folder / f"{s.stem}.o" for s in sources]
    run([[compiler, *flags, "-c", str(s), "-o", str(o)]
         for s, o in zip(sources, objects, strict=True)])
    return objects


# -- the C library ------------------------------------------------------------------------

C_FLAGS = ["-O3", "-fPIC", "-fno-math-errno", "-ffp-contract=off"]
"""(sqrt as one instruction; no fused multiply-add: the folds repeat torch's float32 ops)"""


def library_path() -> Path:
    """The C library, built now where missing (``RuntimeError``: it cannot be)."""
    cc, version = compiler("CC", ("cc", "gcc"), "C")
    runtime = openmp_runtime()

    def make(folder: Path, target: Path) -> None:
        log.info("normwatch: building its C kernels (once per machine and compiler, ~2 s)")
        if runtime is not None:
            try:  # linked to torch's runtime alone: -lgomp would load a second one
                objects = _compiled(cc, [*C_FLAGS, "-fopenmp"], C_SOURCES, folder)
                return run([[cc, "-shared", "-o", str(target), *map(str, objects), runtime,
                             f"-Wl,-rpath,{Path(runtime).parent}"]])
            except (OSError, RuntimeError) as exc:
                log.debug("normwatch: native kernel built single-threaded (%s)", exc)
        objects = _compiled(cc, C_FLAGS, C_SOURCES, folder)
        run([[cc, "-shared", "-o", str(target), *map(str, objects)]])

    return built("rows-{key}.so", (*C_SOURCES, *C_HEADERS),
                 version + str(runtime) + " ".join(C_FLAGS), make)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled C library (built now if not cached), or ``None`` where it cannot be
    (no compiler, a failed build, ``NORMWATCH_NATIVE=0``): then torch's reductions."""
    if os.environ.get("NORMWATCH_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(library_path()))
        _declare(lib)
    except Exception as exc:  # no compiler, a failed build or load: torch's reductions
        log.debug("normwatch: native row kernel unavailable (%s); using torch", exc)
        return None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' argument and result types (the C sources' signatures)."""
    i64, f32, f64, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_void_p
    i32 = ctypes.c_int
    i64s, ptrs = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p)
    signatures: dict[str, tuple[list[object], object]] = {
        "normwatch_rows": ([ptr, i32, i64, i64, ptr, i32, i64, i64, i64, ptr, i32, i32], i32),
        "normwatch_grad_rows": ([ptr, ptr, i32, i64, i64, ptr, i32], i32),
        "normwatch_rows_planned": ([ptr, ptr, ptr, ptr], i32),
        "normwatch_grad_rows_planned": ([ptr, ptr, ptr, ptr], i32),
        "normwatch_through": ([ptr, ptr, ptr, ptr, ptr, ptr, f64], i32),
        "normwatch_accumulate": ([i64, ptr, i64, ptr, i64, i64, ptr], i32),
        "normwatch_fold": ([i64, ptrs, ptr, i32, f32, f32, f64, i64s, i64, ptr], i32),
        "normwatch_fold_grads": ([i64, ptrs, ptr, i64, ptrs, ptr, ptr], i32),
        "normwatch_sample": ([i64, i32, i64s, i64s, i64s, ctypes.POINTER(f64), ptrs, ptrs,
                              ptr, i32, ptr, i32], i32),
        "normwatch_hash": ([ptr, i32, i64], i64),
        "normwatch_threaded": ([], i32),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result


def threaded() -> bool:
    """Whether the kernel splits rows over torch's own threads: built with OpenMP and
    linked to the runtime torch's threads run on (:func:`openmp_runtime`)."""
    lib = library()
    return lib is not None and _built_threaded(lib)


@functools.cache
def _built_threaded(lib: ctypes.CDLL) -> bool:
    return bool(lib.normwatch_threaded())  # (asked once per library: a ctypes call)


def openmp_runtime() -> str | None:
    """The file of GNU OpenMP (libgomp) torch's threads run on, loaded in this process:
    linked to it, the kernel's parallel regions use torch's thread pool (another
    runtime would start threads of its own, competing with torch's). ``None``: another
    backend or runtime, or not Linux; the kernel is then built single-threaded."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return torchs_libgomp(maps, Path(torch.__file__).parent)


def torchs_libgomp(maps: str, package: Path) -> str | None:
    """The libgomp among the files mapped in ``maps`` (``/proc/self/maps``' text) that
    torch's package (``package``: its folder) ships, else the first one mapped."""
    found = [path for path in dict.fromkeys(line.split()[-1] for line in maps.splitlines()
                                            if "/" in line)
             if Path(path).name.startswith("libgomp") and ".so" in Path(path).name]
    homes = (f"{package}/", f"{package.parent / 'torch.libs'}/")  # torch/lib, a wheel's
    return next((p for p in found if p.startswith(homes)), found[0] if found else None)


def pointers(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    """The tensors' data pointers, as a C array (the tensors must outlive its use)."""
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


# -- the C++ module -----------------------------------------------------------------------

def lane_path() -> Path:
    """The C++ module, built now where missing (~40 s on 2 cores, once per machine and torch;
    ``RuntimeError``: it cannot be)."""
    from torch.utils import cpp_extension

    cxx, version = compiler("CXX", ("c++", "g++"), "C++")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib = Path(torch.__file__).parent / "lib"
    flags = ["-O2", "-fPIC", "-std=c++20", "-w", *(f"-I{p}" for p in includes)]
    link = ["-shared", f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10",
            f"-Wl,-rpath,{lib}"]

    def make(folder: Path, target: Path) -> None:
        log.info("normwatch: building its C++ hooks (once per machine and torch, ~40 s on "
                 "2 cores)")
        objects = _compiled(cxx, flags, CPP_SOURCES, folder)
        run([[cxx, *map(str, objects), *link, "-o", str(target)]])

    salt = version + sys.version + torch.__version__ + " ".join([cxx, *flags, *link])
    return built(f"lane-{{key}}{sysconfig.get_config_var('EXT_SUFFIX')}",
                 (*CPP_SOURCES, *CPP_HEADERS), salt, make)


def load(path: Path) -> ModuleType:
    """The C++ module at ``path``, loaded."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_loader(NAME, loader)
    if spec is None:
        raise ImportError(f"no spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
