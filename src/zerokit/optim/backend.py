"""Which implementation of the host optimizer kernels runs, and with how many threads.

`impl` names one, everywhere in zerokit.optim:

    None        the default: ZEROKIT_FORCE_FALLBACK=1 -> "fallback"; else ZEROKIT_HOST_ISA if set;
                else the best native ISA of this CPU; "fallback" when the extension is not built
    "native"    the best native ISA of this CPU
    "avx512", "avx2", "scalar"   that native ISA (a lower one than the CPU's best is allowed, so
                tests cover every path on one machine)
    "fallback"  pure torch, same semantics (zerokit/optim/fallback.py)

Threads follow torch.get_num_threads() unless a `threads` argument says otherwise.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

ISAS = ("scalar", "avx2", "avx512")  # index = the binding's isa code
IMPLS = ("native", *ISAS, "fallback")

# torch dtype -> the binding's dtype code (kernels/step_args.h, enum DType)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_DTYPE = -1

_native: ModuleType | None = None
_native_error: str | None = None
_loaded = False
_warned = False


def native_module() -> ModuleType | None:
    """The compiled extension, or None when it was not built (the reason is kept for kernel_info)."""
    global _native, _native_error, _loaded
    if not _loaded:
        _loaded = True
        try:
            from zerokit.optim import _host_kernels

            _native = _host_kernels
        except ImportError as e:
            _native_error = str(e)
    return _native


@dataclass(frozen=True)
class Impl:
    """A resolved choice: `isa` is None for the fallback."""

    isa: str | None
    threads: int

    @property
    def native(self) -> bool:
        return self.isa is not None

    @property
    def isa_code(self) -> int:
        return ISAS.index(self.isa)


def _default_name() -> str:
    if os.environ.get("ZEROKIT_FORCE_FALLBACK", "") not in ("", "0"):
        return "fallback"
    env_isa = os.environ.get("ZEROKIT_HOST_ISA", "")
    if env_isa:
        if env_isa not in IMPLS:
            raise ValueError(f"ZEROKIT_HOST_ISA={env_isa!r} is not one of {IMPLS}")
        return env_isa
    return "native"


def resolve(impl: str | None = None, threads: int | None = None) -> Impl:
    """Turns an `impl` name and a thread count (None: torch.get_num_threads()) into an Impl."""
    global _warned
    explicit = impl is not None
    name = impl if explicit else _default_name()
    if name not in IMPLS:
        raise ValueError(f"impl={name!r} is not one of {(None, *IMPLS)}")
    if threads is None:
        threads = torch.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive int (or None for torch.get_num_threads())")
    if name == "fallback":
        return Impl(None, threads)
    mod = native_module()
    if mod is None:
        if explicit:
            raise RuntimeError(f"impl={name!r} needs the native extension, which is not built: {_native_error}")
        if not _warned:
            _warned = True
            warnings.warn(
                "zerokit.optim: native host kernels not built "
                f"({_native_error}); using the pure-torch fallback (same numbers, slower). "
                "Reinstall with a C++ compiler to build them.",
                RuntimeWarning,
                stacklevel=3,
            )
        return Impl(None, threads)
    if name == "native":
        return Impl(ISAS[mod.best_isa()], threads)
    if not mod.isa_supported(ISAS.index(name)):
        raise ValueError(
            f"impl={name!r} is not supported on this CPU; available: {available_isas()}"
        )
    return Impl(name, threads)


def available_isas() -> list[str]:
    """Native ISAs this build can run on this CPU, best first (empty without the extension)."""
    mod = native_module()
    if mod is None:
        return []
    return [isa for i, isa in reversed(list(enumerate(ISAS))) if mod.isa_supported(i)]


def kernel_info(impl: str | None = None, threads: int | None = None) -> dict:
    """What a call with these arguments would run, e.g.
    {"backend": "native", "isa": "avx512", "threads": 2, "openmp": True, "available": [...]}."""
    chosen = resolve(impl, threads)
    mod = native_module()
    info = {
        "backend": "native" if chosen.native else "fallback",
        "isa": chosen.isa,
        "threads": chosen.threads,
        "available": available_isas(),
    }
    if mod is not None:
        info["openmp"] = bool(mod.has_openmp())
    else:
        info["native_error"] = _native_error
    return info
