"""Seccomp filters for the places user native code runs (x86-64 Linux).

Two filters, written as classic BPF and installed with prctl through ctypes
(no dependency: the program is a few dozen instructions, and libseccomp may
not be on every machine that runs the device):

* ``install_probe()`` — in the throwaway child that loads a module or a
  native op library first (``probe.in_child``).  Anything outside what
  loading needs ends the child at once (SECCOMP_RET_KILL_PROCESS): exec, a
  new process, sockets or sends on inherited ones, opening a file for
  writing or creating one, renaming, deleting or chmodding anything,
  signalling another process, ptrace, and the administrative calls root
  could make (mount, modules, reboot …).  The probe then reports a crash
  (SIGSYS), the load is refused, and the core never maps the code: a
  constructor or DT_NEEDED library that tries any of it never gets to do it
  in the core either.
* ``install_core()`` — in every core, after its start-up (the SDK shim and
  the firmware operators are built and loaded) and before the first job:
  no exec, no new sockets, no ptrace, no administrative calls
  (SECCOMP_RET_ERRNO EPERM, so Python code gets an OSError).  Files may
  still be created in the core: the firmware kernel library writes
  temporary files while planning (onnxruntime), so "no new files" holds in
  the probe only (docs/reliability.md says what this does and does not stop).

Both filters are inherited by every thread and child and cannot be removed.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
CLONE_THREAD = 0x00010000
# open flags that write or create: O_WRONLY O_RDWR O_CREAT O_TRUNC O_APPEND O_TMPFILE(__O_TMPFILE)
WRITE_FLAGS = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000 | 0o20000000

# x86-64 syscall numbers (asm/unistd_64.h)
NR = dict(open=2, socket=41, connect=42, accept=43, sendto=44, sendmsg=46, bind=49, listen=50, socketpair=53,
          clone=56, fork=57, vfork=58, execve=59, kill=62, truncate=76, rename=82, mkdir=83, rmdir=84, creat=85,
          link=86, unlink=87, symlink=88, chmod=90, fchmod=91, chown=92, fchown=93, lchown=94, ptrace=101,
          setuid=105, setgid=106, setresuid=117, setresgid=119, mknod=133, pivot_root=155, chroot=161, mount=165,
          umount2=166, swapon=167, swapoff=168, reboot=169, init_module=175, delete_module=176, tkill=200,
          tgkill=234, kexec_load=246, add_key=248, request_key=249, keyctl=250, openat=257, mkdirat=258,
          mknodat=259, fchownat=260, unlinkat=263, renameat=264, linkat=265, symlinkat=266, fchmodat=268,
          unshare=272, accept4=288, perf_event_open=298, name_to_handle_at=303, open_by_handle_at=304,
          sendmmsg=307, setns=308, process_vm_readv=310, process_vm_writev=311, finit_module=313, renameat2=316,
          kexec_file_load=320, bpf=321, execveat=322, io_uring_setup=425, io_uring_enter=426,
          io_uring_register=427, clone3=435, openat2=437, pidfd_getfd=438, fchmodat2=452)

# What no core ever needs once started.
ADMIN = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "mount", "umount2", "pivot_root",
         "chroot", "swapon", "swapoff", "reboot", "init_module", "finit_module", "delete_module", "kexec_load",
         "kexec_file_load", "unshare", "setns", "bpf", "perf_event_open", "io_uring_setup", "io_uring_enter",
         "io_uring_register", "add_key", "request_key", "keyctl", "name_to_handle_at", "open_by_handle_at",
         "setuid", "setgid", "setresuid", "setresgid")
CORE_DENY = ("execve", "execveat", "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4") + ADMIN
PROBE_DENY = CORE_DENY + (
    "fork", "vfork", "sendto", "sendmsg", "sendmmsg", "kill", "tkill", "tgkill", "creat", "openat2",
    "truncate", "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat", "symlink",
    "symlinkat", "unlink", "unlinkat", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown",
    "fchownat", "mknod", "mknodat")

_INSN = struct.Struct("<HBBI")
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def _arg(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of seccomp_data.args[i] (little endian)


def program(deny, action: int, *, open_flags: bool, threads_only: bool, clone3_enosys: bool) -> bytes:
    """The filter: the x86-64 ABI only; ``deny`` → ``action``; with
    ``open_flags``, open/openat with a write or create flag → ``action``;
    with ``threads_only``, clone without CLONE_THREAD → ``action``."""
    p = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, RET_KILL_PROCESS),
         (_LD_ABS, 0, 0, 0), (_JGE, 0, 1, X32_BIT), (_RET, 0, 0, RET_KILL_PROCESS)]
    for name in deny:
        p += [(_JEQ, 0, 1, NR[name]), (_RET, 0, 0, action)]
    if clone3_enosys:  # its flags are in memory BPF cannot read: make libc fall back to clone
        p += [(_JEQ, 0, 1, NR["clone3"]), (_RET, 0, 0, RET_ERRNO | 38)]
    if open_flags:
        for name, arg in (("open", 1), ("openat", 2)):
            p += [(_JEQ, 0, 4, NR[name]), (_LD_ABS, 0, 0, _arg(arg)), (_JSET, 0, 1, WRITE_FLAGS),
                  (_RET, 0, 0, action), (_RET, 0, 0, RET_ALLOW)]
    if threads_only:
        p += [(_JEQ, 0, 4, NR["clone"]), (_LD_ABS, 0, 0, _arg(0)), (_JSET, 0, 1, CLONE_THREAD),
              (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, action)]
    p.append((_RET, 0, 0, RET_ALLOW))
    return b"".join(_INSN.pack(*i) for i in p)


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() == "x86_64"


def _install(code: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Fprog(len(code) // _INSN.size, ctypes.addressof(buf))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def install_probe() -> None:
    _install(program(PROBE_DENY, RET_KILL_PROCESS, open_flags=True, threads_only=True, clone3_enosys=True))


def install_core() -> None:
    _install(program(CORE_DENY, RET_ERRNO | 1, open_flags=False, threads_only=False, clone3_enosys=False))


SANDBOX_ENV = "DSPX_SANDBOX"  # "0" turns both filters off (for debugging a core)


def enabled() -> bool:
    return supported() and os.environ.get(SANDBOX_ENV, "1") != "0"
