"""Seccomp filters for the places user native code runs (x86-64 Linux).

Three filters, written as classic BPF and installed with prctl through ctypes
(no dependency: each program is a few hundred instructions at most, and libseccomp may
not be on every machine that runs the device):

* ``install_probe()`` — in the throwaway child that loads a module or a
  native op library first (``probe.in_child``, forked by the zygote).  Anything outside what
  loading needs ends the child at once (SECCOMP_RET_KILL_PROCESS): exec, a
  new process, sockets or sends on inherited ones, opening a file for
  writing or creating one, renaming, deleting or chmodding anything,
  signalling another process, ptrace, and the administrative calls root
  could make (mount, modules, reboot …).  The probe then reports a crash
  (SIGSYS), the load is refused, and the core never maps the code: a
  constructor or DT_NEEDED library that tries any of it never gets to do it
  in the core either.
* ``install_core()`` — in every core, after its start-up (the SDK shim is
  built and loaded, the planner forked) and before the first job: an
  allow-list of what a core uses (CORE_ALLOW); no new files (open/openat
  only read-only, no mkdir/unlink/rename …), no sockets, no fork (clone
  only with CLONE_THREAD), signals only to itself — EPERM, so Python code
  gets an OSError; exec, ptrace and the administrative calls
  end the core (CORE_KILL).  docs/containment.md says what it allows,
  why, and what it does not stop.
* ``install_zygote()`` — in the core's probe zygote (probe.Zygote), which
  forks the probes: the core's list, plus fork, wait4, alarm and SIGKILL to
  a pid > 0.
* ``install_planner()`` — in the core's planner (planner.py), which writes
  onnxruntime's optimized graphs to its temporary directory: no exec, no
  sockets, no administrative calls.

Before the filters: ``drop_privileges()`` (no capability, even under uid 0;
non-dumpable) and ``landlock()`` (reads beneath given trees only, no writes,
no signals outside).  docs/containment.md, "The seccomp filters", lists what each allows and why.

The filters are inherited by every thread and child and cannot be removed.
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

# x86-64 syscall numbers (asm/unistd_64.h; tests/device/core/test_sandbox.py checks them against it)
NR = dict(read=0, write=1, open=2, close=3, stat=4, fstat=5, lstat=6, poll=7, lseek=8, mmap=9, mprotect=10,
          munmap=11, brk=12, rt_sigaction=13, rt_sigprocmask=14, rt_sigreturn=15, ioctl=16, pread64=17,
          pwrite64=18, readv=19, writev=20, access=21, pipe=22, select=23, sched_yield=24, mremap=25, msync=26,
          mincore=27, madvise=28, dup=32, dup2=33, nanosleep=35, getitimer=36, alarm=37, setitimer=38,
          getpid=39, sendfile=40, socket=41, connect=42, accept=43, sendto=44, recvfrom=45, sendmsg=46,
          recvmsg=47, shutdown=48, bind=49, listen=50, getsockname=51, getpeername=52, socketpair=53,
          setsockopt=54, getsockopt=55, clone=56, fork=57, vfork=58, execve=59, exit=60, wait4=61, kill=62,
          uname=63, fcntl=72, flock=73, fsync=74, fdatasync=75, truncate=76, ftruncate=77, getdents=78,
          getcwd=79, chdir=80, fchdir=81, rename=82, mkdir=83, rmdir=84, creat=85, link=86, unlink=87,
          symlink=88, readlink=89, chmod=90, fchmod=91, chown=92, fchown=93, lchown=94, umask=95,
          gettimeofday=96, getrlimit=97, getrusage=98, sysinfo=99, times=100, ptrace=101, getuid=102,
          syslog=103, getgid=104, setuid=105, setgid=106, geteuid=107, getegid=108, setpgid=109, getppid=110,
          getpgrp=111, setsid=112, setreuid=113, setregid=114, getgroups=115, setgroups=116, setresuid=117,
          getresuid=118, setresgid=119, getresgid=120, setfsuid=122, setfsgid=123, capget=125, capset=126,
          rt_sigtimedwait=128, rt_sigqueueinfo=129, rt_sigsuspend=130, sigaltstack=131, mknod=133, uselib=134,
          personality=135, ustat=136, statfs=137, fstatfs=138, sysfs=139, getpriority=140, sched_setparam=142,
          sched_getparam=143, sched_setscheduler=144, sched_getscheduler=145, sched_get_priority_max=146,
          sched_get_priority_min=147, mlock=149, munlock=150, vhangup=153, pivot_root=155, prctl=157,
          arch_prctl=158, adjtimex=159, chroot=161, sync=162, acct=163, settimeofday=164, mount=165,
          umount2=166, swapon=167, swapoff=168, reboot=169, sethostname=170, setdomainname=171, iopl=172,
          ioperm=173, init_module=175, delete_module=176, quotactl=179, nfsservctl=180, gettid=186, tkill=200,
          time=201, futex=202, sched_setaffinity=203, sched_getaffinity=204, lookup_dcookie=212, getdents64=217,
          set_tid_address=218, restart_syscall=219, fadvise64=221, timer_create=222, timer_settime=223,
          timer_gettime=224, timer_delete=226, clock_settime=227, clock_gettime=228, clock_getres=229,
          clock_nanosleep=230, exit_group=231, epoll_wait=232, epoll_ctl=233, tgkill=234, mbind=237,
          set_mempolicy=238, get_mempolicy=239, mq_open=240, kexec_load=246, waitid=247, add_key=248,
          request_key=249, keyctl=250, inotify_add_watch=254, inotify_rm_watch=255, openat=257, mkdirat=258,
          mknodat=259, fchownat=260, newfstatat=262, unlinkat=263, renameat=264, linkat=265, symlinkat=266,
          readlinkat=267, fchmodat=268, faccessat=269, pselect6=270, ppoll=271, unshare=272,
          set_robust_list=273, get_robust_list=274, splice=275, tee=276, vmsplice=278, move_pages=279,
          utimensat=280, epoll_pwait=281, timerfd_create=283, eventfd=284, fallocate=285, timerfd_settime=286,
          timerfd_gettime=287, accept4=288, signalfd4=289, eventfd2=290, epoll_create1=291, dup3=292, pipe2=293,
          inotify_init1=294, preadv=295, pwritev=296, rt_tgsigqueueinfo=297, perf_event_open=298, recvmmsg=299,
          fanotify_init=300, fanotify_mark=301, prlimit64=302, name_to_handle_at=303, open_by_handle_at=304,
          clock_adjtime=305, syncfs=306, sendmmsg=307, setns=308, getcpu=309, process_vm_readv=310,
          process_vm_writev=311, kcmp=312, finit_module=313, sched_getattr=315, renameat2=316, getrandom=318,
          memfd_create=319, kexec_file_load=320, bpf=321, execveat=322, userfaultfd=323, membarrier=324,
          mlock2=325, pkey_mprotect=329, pkey_alloc=330, pkey_free=331, statx=332, rseq=334,
          pidfd_send_signal=424, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428,
          move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, pidfd_open=434, clone3=435,
          close_range=436, openat2=437, pidfd_getfd=438, faccessat2=439, process_madvise=440, epoll_pwait2=441,
          mount_setattr=442, copy_file_range=326, landlock_create_ruleset=444, landlock_add_rule=445,
          landlock_restrict_self=446, memfd_secret=447, futex_waitv=449, fchmodat2=452)

# ---------------------------------------------------------------- the core's allow-list
# Everything a core does after its start-up, collected with strace -f -c over
# the device tests (inference with TVM, onnxruntime and torch kernels, RPC,
# Python and native op libraries, the LLM, the load probe, restarts) and
# checked with DSPX_SANDBOX=log (docs/containment.md).  Grouped by why.
CORE_ALLOW = (
    # the hot path first (the filter is a linear scan): thread pools, the
    # front's channel and the clients' sockets (existing ones only), memory
    "futex", "recvmsg", "sendmsg", "sendto", "recvfrom", "read", "write", "mmap", "munmap", "madvise", "mprotect",
    "brk", "mremap", "poll", "ppoll", "epoll_wait", "epoll_pwait", "epoll_pwait2", "epoll_ctl", "epoll_create1",
    "select", "pselect6", "sched_yield", "clock_gettime", "clock_getres", "gettimeofday", "time",
    "clock_nanosleep", "nanosleep", "getcpu", "membarrier", "mbind", "get_mempolicy", "set_mempolicy", "mincore",
    "msync", "getrandom",
    # reading files (imports of TVM/torch/onnxruntime/numpy, dlopen of kernel
    # libraries, /proc/self): open/openat are allowed read-only (below)
    "close", "close_range", "lseek", "pread64", "preadv", "readv", "newfstatat", "fstat", "stat", "lstat", "statx",
    "access", "faccessat", "faccessat2", "readlink", "readlinkat", "getdents64", "getcwd", "statfs", "fstatfs",
    "fadvise64", "fcntl", "flock",  # and ioctl, but not every request (core_program)
    # writing only to fds it already holds (memfds, its log, sockets): staged
    # modules and dmabufs are memfds, written and sealed in place
    "pwrite64", "writev", "pwritev", "memfd_create", "ftruncate", "fallocate", "fsync", "fdatasync",
    "dup", "dup2", "dup3", "pipe", "pipe2", "eventfd", "eventfd2", "timerfd_create", "timerfd_settime",
    "timerfd_gettime", "getsockopt", "setsockopt", "getsockname", "getpeername", "shutdown",
    # threads (clone: threads only, checked below), signal handlers and masks
    # (the front's abort signals), timers; signals are sent only to itself (below)
    "set_robust_list", "get_robust_list", "rseq", "set_tid_address", "gettid", "exit", "exit_group",
    "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "sigaltstack",
    "restart_syscall", "setitimer", "getitimer", "timer_create", "timer_settime", "timer_gettime",
    "timer_delete",
    # who and where it is, its limits and CPU placement (thread pools size themselves)
    "getpid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "getpgrp", "uname", "sysinfo", "times", "getrusage", "getrlimit", "prlimit64", "getpriority",
    "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_getscheduler", "sched_getattr",
    "sched_get_priority_max", "sched_get_priority_min", "arch_prctl", "prctl", "umask",
)
# Refused with EPERM, like everything not allowed above, but named so the
# doc and the tests can say so: new files (open/openat with a write or create
# flag, see WRITE_FLAGS) and changes to the file system, new sockets, new
# processes (fork, vfork: subprocess; clone without CLONE_THREAD, below),
# signals to any other process (below), namespaces.
CORE_REFUSED = ("creat", "openat2", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat",
                "renameat2", "link", "linkat", "symlink", "symlinkat", "truncate", "chmod", "fchmod", "fchmodat",
                "fchmodat2", "chown", "fchown", "lchown", "fchownat", "mknod", "mknodat", "utimensat", "socket",
                "socketpair", "connect", "bind", "listen", "accept", "accept4", "vfork", "fork", "tkill",
                "pidfd_open", "pidfd_send_signal")
# What ends the core at once (SECCOMP_RET_KILL_PROCESS): no legitimate path
# in a core makes these, and code that tries is hostile — running another
# program, reading or writing another process, administering the machine.
CORE_KILL = ("execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
             "mount", "umount2", "pivot_root", "chroot", "swapon", "swapoff", "reboot", "init_module", "finit_module",
             "delete_module", "kexec_load", "kexec_file_load", "unshare", "setns", "bpf", "perf_event_open",
             "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "add_key", "request_key",
             "keyctl", "name_to_handle_at", "open_by_handle_at", "setuid", "setgid", "setreuid", "setregid",
             "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups", "capset", "iopl", "ioperm", "syslog",
             "settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname",
             "quotactl", "acct", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "fspick",
             "mount_setattr", "uselib", "personality", "vhangup", "fanotify_init", "lookup_dcookie")
# clone: threads only in a core (a plain fork in the zygote); never a new namespace
# (CLONE_NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET, and NEWTIME).
CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | \
    0x40000000 | 0x00000080
ENOSYS, EPERM = 38, 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
RET_LOG = 0x7FFC0000

# ---------------------------------------------------------------- the probe's deny-list
# The probe (a fork of the zygote) stacks this on the zygote's filter: what the
# core merely refuses, the probe dies of — so a load that tries it is refused.
CORE_DENY = CORE_KILL + CORE_REFUSED
PROBE_DENY = CORE_DENY + ("sendto", "sendmsg", "sendmmsg", "kill", "tgkill", "rt_sigqueueinfo",
                          "rt_tgsigqueueinfo")
# Signals a core may send, and only to itself (arg 0 is its pid, both 32-bit
# halves compared): raise() and pthread_kill are tgkill(getpid(), tid).
SELF_SIGNALS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
SIGKILL = 9

_INSN = struct.Struct("<HBBI")
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def _arg(i: int) -> int:
    return 16 + 8 * i  # low 32 bits of seccomp_data.args[i] (little endian)


def _arg_hi(i: int) -> int:
    return 20 + 8 * i  # its high 32 bits


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


def core_program(default: int = RET_ERRNO | EPERM, *, pid: int, zygote: bool = False) -> bytes:
    """The core's filter (``pid``: the core's own): CORE_ALLOW is allowed
    (first: the hot calls pass after a few comparisons); clone only with
    CLONE_THREAD and without namespace flags; clone3 is ENOSYS (its flags
    are in memory BPF cannot read: libc falls back to clone); kill, tgkill,
    rt_(tg)sigqueueinfo only to ``pid``; open/openat only without a write or
    create flag; ioctl but not TIOCSTI/TIOCLINUX (typing into a terminal the
    device was started from); CORE_KILL ends the process; anything else gets
    ``default`` (EPERM, so a rare path fails as an OSError in its caller, not
    as a dead core; RET_LOG for DSPX_SANDBOX=log, which then logs the kills too).

    ``zygote``: the probe zygote's filter (probe.Zygote), the same but it
    may fork (clone without CLONE_THREAD), wait for its children, set their
    alarm, and SIGKILL a pid > 0 (a hung probe child)."""
    kill = RET_KILL_PROCESS if default != RET_LOG else RET_LOG
    p = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, RET_KILL_PROCESS),
         (_LD_ABS, 0, 0, 0), (_JGE, 0, 1, X32_BIT), (_RET, 0, 0, RET_KILL_PROCESS)]
    for name in CORE_ALLOW + (("wait4", "alarm") if zygote else ()):
        p += [(_JEQ, 0, 1, NR[name]), (_RET, 0, 0, RET_ALLOW)]
    if zygote:  # a fork, never a namespace; SIGKILL to a pid > 0 (its hung child)
        p += [(_JEQ, 0, 4, NR["clone"]), (_LD_ABS, 0, 0, _arg(0)), (_JSET, 0, 1, CLONE_NEW_NAMESPACES),
              (_RET, 0, 0, default), (_RET, 0, 0, RET_ALLOW)]
        p += [(_JEQ, 0, 9, NR["kill"]), (_LD_ABS, 0, 0, _arg_hi(0)), (_JEQ, 0, 6, 0),
              (_LD_ABS, 0, 0, _arg(0)), (_JGE, 4, 0, 0x80000000), (_JEQ, 3, 0, 0),
              (_LD_ABS, 0, 0, _arg(1)), (_JEQ, 0, 1, SIGKILL), (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    else:  # threads only
        p += [(_JEQ, 0, 5, NR["clone"]), (_LD_ABS, 0, 0, _arg(0)), (_JSET, 2, 0, CLONE_NEW_NAMESPACES),
              (_JSET, 0, 1, CLONE_THREAD), (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    for name in SELF_SIGNALS[int(zygote):]:  # arg 0 == pid, both halves
        p += [(_JEQ, 0, 6, NR[name]), (_LD_ABS, 0, 0, _arg(0)), (_JEQ, 0, 3, pid), (_LD_ABS, 0, 0, _arg_hi(0)),
              (_JEQ, 0, 1, 0), (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    p += [(_JEQ, 0, 1, NR["clone3"]), (_RET, 0, 0, RET_ERRNO | ENOSYS)]
    for name, arg in (("open", 1), ("openat", 2)):
        p += [(_JEQ, 0, 4, NR[name]), (_LD_ABS, 0, 0, _arg(arg)), (_JSET, 0, 1, WRITE_FLAGS),
              (_RET, 0, 0, default), (_RET, 0, 0, RET_ALLOW)]
    p += [(_JEQ, 0, 5, NR["ioctl"]), (_LD_ABS, 0, 0, _arg(1)), (_JEQ, 2, 0, TIOCSTI), (_JEQ, 1, 0, TIOCLINUX),
          (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    for name in CORE_KILL:
        p += [(_JEQ, 0, 1, NR[name]), (_RET, 0, 0, kill)]
    p.append((_RET, 0, 0, default))
    return b"".join(_INSN.pack(*i) for i in p)


SOCKETS = ("socket", "socketpair", "connect", "bind", "listen", "accept", "accept4")


def install_planner() -> None:
    """The planner (planner.py) writes files in its own temporary directory,
    and nothing else: no exec, no sockets, no administrative calls."""
    _install(program(CORE_KILL + SOCKETS, RET_ERRNO | EPERM, open_flags=False, threads_only=False,
                     clone3_enosys=False))


def install_core(log_only: bool = False) -> None:
    _install(core_program(RET_LOG if log_only else RET_ERRNO | EPERM, pid=os.getpid()))


def install_zygote() -> None:
    _install(core_program(pid=os.getpid(), zygote=True))


# ---------------------------------------------------------------- capabilities, Landlock
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_DUMPABLE = 24, 47, 4, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def drop_privileges() -> None:
    """Every capability gone for good, even under uid 0: the bounding set
    emptied (PR_CAPBSET_DROP, so no exec could bring one back), ambient
    cleared, effective/permitted/inheritable emptied (capset); and the process
    made non-dumpable, so no process of the same uid without CAP_SYS_PTRACE
    (another core, a probe) may open its /proc/<pid>/fd, mem or maps.  With
    no capability left, this process in turn cannot open those of a process
    that has any (the front), nor of a non-dumpable one."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: an unprivileged start has none
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset to no capabilities failed")
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
# LANDLOCK_ACCESS_FS_*: execute, write_file, read_file, read_dir, then the
# changes to the tree (remove, make_*, refer, truncate, ioctl_dev by ABI).
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
LANDLOCK_SCOPE_SIGNAL = 2  # ABI 6: no signal to a process outside this domain


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 without it (not built, or not in the LSM list)."""
    if not supported():
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    v = libc.syscall(NR["landlock_create_ruleset"], None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(v, 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(read_paths) -> int:
    """Confine this process (and what it forks) with Landlock: no file
    written, created, removed or renamed anywhere, files read only beneath
    ``read_paths``, and (ABI >= 6) no signal to a process outside this
    domain.  Fds already open (memfds, sockets, its log) are not affected.
    Returns the ABI used, 0 where the kernel has no Landlock."""
    abi = landlock_abi()
    if abi == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    handled = _FS_ALL_BY_ABI.get(abi, (1 << 16) - 1)
    attr = _RulesetAttr(handled, 0, LANDLOCK_SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else 8
    ruleset = libc.syscall(NR["landlock_create_ruleset"], ctypes.byref(attr), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path in read_paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                read = FS_READ_FILE | (FS_READ_DIR if os.path.isdir(path) else 0)
                rule = _PathBeneath(read, fd)
                if libc.syscall(NR["landlock_add_rule"], ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                ctypes.byref(rule), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(NR["landlock_restrict_self"], ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


# "0" turns both filters off (for debugging a core); "log": the core's filter
# refuses nothing and logs to the kernel log (dmesg, "audit: type=1326") what
# it would have refused — how the allow-list was checked against the tests.
SANDBOX_ENV = "DSPX_SANDBOX"


def enabled() -> bool:
    return supported() and os.environ.get(SANDBOX_ENV, "1") != "0"


def log_only() -> bool:
    return os.environ.get(SANDBOX_ENV) == "log"


# ---------------------------------------------------------------- the front's allow-list
# The front (front/loop.py) once it has started: its listening socket, the
# cores' channels and the spawner's exist, every core has said hello.  From
# then on it serves clients and supervises cores, and it never needs to run a
# program or make a socket: cores are started by the spawner
# (front/spawner.py), forked before this filter.  Collected with strace -f -c
# over the device tests and checked with DSPX_SANDBOX=log.  Grouped by why.
FRONT_ALLOW = (
    # the event loop: epoll, clients' and cores' messages with their fds
    "epoll_wait", "epoll_pwait", "epoll_ctl", "recvmsg", "sendmsg", "recvfrom", "sendto", "read", "write",
    "poll", "ppoll", "select", "pselect6", "getsockopt", "setsockopt", "getsockname", "getpeername", "shutdown",
    "close", "fcntl", "ioctl", "futex", "clock_gettime", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    "sched_yield", "getrandom", "restart_syscall",
    # memory: Python's heap, the status pages and kept copies (memfds it writes and seals)
    "mmap", "munmap", "mremap", "mprotect", "madvise", "brk", "memfd_create", "ftruncate", "fallocate",
    "pread64", "pwrite64", "readv", "writev", "lseek", "copy_file_range", "sendfile", "dup", "dup2", "dup3",
    "fstat", "newfstatat", "statx",
    "fstatfs",  # BUF_ATTACH: a buffer must be on shmem (not hugetlbfs) for a core to map it
    # files: a client's module bytes, /proc for the cores' RSS (psutil), the spare fd, its log and trace
    "open", "openat", "stat", "lstat", "access", "faccessat", "faccessat2", "readlink", "readlinkat",
    "getdents64", "getcwd", "fsync", "fdatasync", "unlink", "unlinkat",  # the socket path at shutdown
    # supervising cores: signals (abort, terminate, kill), their exit status
    "kill", "tgkill", "tkill", "wait4", "waitid", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn",
    "sigaltstack", "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid",
    # threads (Python may start one: DSPX_TRACE's writer), exit
    "set_robust_list", "rseq", "set_tid_address", "exit", "exit_group", "prlimit64", "getrlimit",
    "sched_getaffinity", "uname", "sysinfo", "prctl", "arch_prctl", "getrusage", "times",
)
# What ends the front at once: running a program (its job is the spawner's),
# reading or writing another process, administering the machine.
FRONT_KILL = ("execve", "execveat") + tuple(n for n in CORE_KILL if n not in ("execve", "execveat"))


def front_program(listen_fd: int, default: int = RET_ERRNO | EPERM) -> bytes:
    """The front's filter: FRONT_ALLOW is allowed; accept4 only on its
    listening socket ``listen_fd``; clone only with CLONE_THREAD (a thread,
    never a process), clone3 ENOSYS (libc falls back to clone); FRONT_KILL
    ends the process; anything else — new sockets (socket, socketpair,
    connect, bind, listen), fork — gets ``default`` (EPERM)."""
    kill = RET_KILL_PROCESS if default != RET_LOG else RET_LOG
    p = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, AUDIT_ARCH_X86_64), (_RET, 0, 0, RET_KILL_PROCESS),
         (_LD_ABS, 0, 0, 0), (_JGE, 0, 1, X32_BIT), (_RET, 0, 0, RET_KILL_PROCESS)]
    for name in FRONT_ALLOW:
        p += [(_JEQ, 0, 1, NR[name]), (_RET, 0, 0, RET_ALLOW)]
    for name in ("accept4", "accept"):
        p += [(_JEQ, 0, 4, NR[name]), (_LD_ABS, 0, 0, _arg(0)), (_JEQ, 0, 1, listen_fd),
              (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    p += [(_JEQ, 0, 4, NR["clone"]), (_LD_ABS, 0, 0, _arg(0)), (_JSET, 0, 1, CLONE_THREAD),
          (_RET, 0, 0, RET_ALLOW), (_RET, 0, 0, default)]
    p += [(_JEQ, 0, 1, NR["clone3"]), (_RET, 0, 0, RET_ERRNO | ENOSYS)]
    for name in FRONT_KILL:
        p += [(_JEQ, 0, 1, NR[name]), (_RET, 0, 0, kill)]
    p.append((_RET, 0, 0, default))
    return b"".join(_INSN.pack(*i) for i in p)


def install_front(listen_fd: int, log_only: bool = False) -> None:
    _install(front_program(listen_fd, RET_LOG if log_only else RET_ERRNO | EPERM))


PR_SET_DUMPABLE = 4


def set_non_dumpable() -> None:
    """PR_SET_DUMPABLE 0: /proc/<pid>/fd, /mem, /environ and ptrace are closed
    to every process without CAP_SYS_PTRACE, even of the same uid; no core
    dump.  Inherited by fork, reset by execve."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")
