"""The x86 CPUID instruction's answer in this process, for the feature flags torch has no probe of.

/proc/cpuinfo lists the host CPU's flags even where this process runs on another (qemu-user's emulated CPU, or a
translator such as Rosetta under Docker), and running a build with instructions the real executor lacks dies of
SIGILL. torch's own probes (torch.cpu._is_avx512_supported and the like) cover AVX2, AVX-512 and VNNI; the kernel
builds also need to know AVX-VNNI (CPUID leaf 7, sub-leaf 1, EAX bit 4). The probe is ten instructions of machine
code called through ctypes from an executable page; where such a page cannot be mapped, or on another
architecture, it answers None and /proc/cpuinfo alone decides.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import platform

# void cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4]) in the System V AMD64 calling convention:
# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid;
# mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx; pop rbx; ret
_CODE = bytes.fromhex("53" "4989d0" "89f8" "89f1" "0fa2"
                      "418900" "41895804" "41894808" "4189500c" "5b" "c3")
_Registers = ctypes.c_uint32 * 4
_pages: list[mmap.mmap] = []  # the executable page lives as long as the process: its function may be called again


@functools.cache
def _function():
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, AttributeError):  # a kernel or policy refusing writable executable pages
        return None
    page.write(_CODE)
    _pages.append(page)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(_Registers))(address)


def registers(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int] | None:
    """(EAX, EBX, ECX, EDX) of CPUID(leaf, subleaf), or None where this process cannot run the probe."""
    function = _function()
    if function is None:
        return None
    out = _Registers()
    function(leaf, subleaf, ctypes.byref(out))
    return tuple(out)


def vendor() -> str | None:
    """The vendor string of leaf 0 ("GenuineIntel", "AuthenticAMD"), or None without the probe."""
    found = registers(0)
    if found is None:
        return None
    _, ebx, ecx, edx = found
    return b"".join(value.to_bytes(4, "little") for value in (ebx, edx, ecx)).decode("ascii", "replace")


def has_avx_vnni() -> bool | None:
    """Whether the CPU this process runs on has AVX-VNNI; None where the probe cannot run."""
    top = registers(0)
    if top is None:
        return None
    if top[0] < 7:
        return False
    if registers(7, 0)[0] < 1:  # leaf 7's EAX: its highest sub-leaf
        return False
    return bool(registers(7, 1)[0] >> 4 & 1)
