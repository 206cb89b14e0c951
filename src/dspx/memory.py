"""Shared memory: the carveout window, dmabufs and DSP address translation.

Vocabulary follows Linux dma-buf: a *dmabuf* is an fd (a sealed memfd in the
simulation) that the host allocates and maps, then *attaches* to the device,
which maps the same pages and answers with the buffer's DSP address in the
carveout *window*.  Sync is explicit per buffer (start/end, read/write); the
simulation counts synced bytes so tests can see which buffers an operation
touched.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass

from . import trace

# Defaults of docs/protocol.md (all configurable).
CARVEOUT_BASE = 0xC000_0000
CARVEOUT_SIZE = 512 << 20
STAGING_SIZE = 468 << 20
KV_SIZE = 12 << 20
PRINTF_SIZE = 64 << 10
DDR_POOL_BASE = 0x1_0200_0000
DDR_POOL_SIZE = 352 << 20
L2_BASE = 0x7E00_0000
L2_SIZE = 1280 << 10

PAGE = mmap.PAGESIZE
U64 = 1 << 64

# DMA_BUF_IOCTL_SYNC flags (linux/dma-buf.h)
SYNC_READ = 1
SYNC_WRITE = 2
SYNC_RW = SYNC_READ | SYNC_WRITE
SYNC_START = 0
SYNC_END = 4

# Seals a dmabuf must carry before the device maps it: its size can never
# change under the device's mapping (a shrink would turn a later access into
# SIGBUS in the device).
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Seals that forbid what a core does with every buffer, a MAP_SHARED
# PROT_READ|PROT_WRITE mapping (linux/fcntl.h; Python lacks FUTURE_WRITE).
F_SEAL_FUTURE_WRITE = 0x10
WRITE_SEALS = {fcntl.F_SEAL_WRITE: "F_SEAL_WRITE", F_SEAL_FUTURE_WRITE: "F_SEAL_FUTURE_WRITE"}
# statfs f_type of shmem (a plain memfd's filesystem) and of hugetlbfs
TMPFS_MAGIC, HUGETLBFS_MAGIC = 0x01021994, 0x958458F6


class AddressError(ValueError):
    """A DSP address range that is not wholly inside one owned buffer."""


class WindowFull(MemoryError):
    def __init__(self, requested: int, free: int, total: int, largest: int):
        super().__init__(f"carveout window has no room for {requested} bytes "
                         f"(free {free}, largest hole {largest}, total {total})")
        self.requested, self.free, self.total, self.largest = requested, free, total, largest


def page_align(n: int, unit: int = PAGE) -> int:
    return (n + unit - 1) // unit * unit


class FirstFit:
    """First-fit allocator over an address range, like the kernel's
    gen_pool_first_fit: the first allocation lands at the base."""

    def __init__(self, base: int, size: int, granule: int = PAGE):
        self.base, self.size, self.granule = base, size, granule
        self._free: list[list[int]] = [[base, size]]  # sorted [addr, size] holes
        self._used: dict[int, int] = {}

    @property
    def used(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.size - self.used

    def alloc(self, size: int) -> int:
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = (size + self.granule - 1) // self.granule * self.granule
        for hole in self._free:
            if hole[1] >= need:
                addr = hole[0]
                hole[0] += need
                hole[1] -= need
                if hole[1] == 0:
                    self._free.remove(hole)
                self._used[addr] = need
                return addr
        largest = max((h[1] for h in self._free), default=0)
        raise WindowFull(size, self.free_bytes, self.size, largest)

    def free(self, addr: int) -> None:
        size = self._used.pop(addr)
        self._free.append([addr, size])
        self._free.sort()
        merged: list[list[int]] = []
        for a, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1][1] += s
            else:
                merged.append([a, s])
        self._free = merged


class Pool:
    """Byte accounting for a device-private pool (DDR pool, L2): watermark and reset."""

    def __init__(self, name: str, base: int, size: int):
        self.name, self.base, self.size = name, base, size
        self.used = 0
        self.peak = 0

    @property
    def free(self) -> int:
        return self.size - self.used

    def take(self, nbytes: int) -> bool:
        if nbytes < 0 or nbytes > self.free:
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def give(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)


# ------------------------------------------------------------------ host side

class DmaBuf:
    """A host-allocated dmabuf: a sealed memfd mapped into this process."""

    def __init__(self, size: int, name: str = "dspx-dmabuf"):
        if size <= 0:
            raise ValueError(f"dmabuf size must be positive, got {size}")
        self.size = page_align(size)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            self.mm = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.dsp_addr: int | None = None
        self.host_addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))  # where this process sees it
        self.synced = {"read": 0, "write": 0}  # bytes covered by completed syncs
        self.sync_calls = 0
        self._syncing: int | None = None
        self._trace_t0 = 0  # begin_cpu_access's time while the process traces (dspx.trace)

    # DMA_BUF_IOCTL_SYNC: whole-buffer granularity, like the real ioctl.
    def sync(self, flags: int) -> None:
        direction = flags & SYNC_RW
        if direction == 0 or flags & ~(SYNC_RW | SYNC_END):
            raise ValueError(f"bad sync flags 0x{flags:x}")
        if flags & SYNC_END:
            if self._syncing != direction:
                raise RuntimeError("sync end without a matching sync start")
            self._syncing = None
            if direction & SYNC_READ:
                self.synced["read"] += self.size
            if direction & SYNC_WRITE:
                self.synced["write"] += self.size
            self.sync_calls += 1
        else:
            self._syncing = direction

    def begin_cpu_access(self, direction: int) -> None:
        if trace.on:  # the host's copy-in (or sync read) lasts until end_cpu_access
            self._trace_t0 = trace.clock()
        self.sync(SYNC_START | direction)

    def end_cpu_access(self, direction: int) -> None:
        self.sync(SYNC_END | direction)
        if trace.on and self._trace_t0:
            trace.complete("copy-in" if direction == SYNC_WRITE else "sync read", self._trace_t0, "host")

    def array(self, offset: int, shape, dtype):
        import numpy as np

        dt = np.dtype(dtype)
        count = 1
        for s in shape:
            count *= int(s)
        if offset < 0 or offset + count * dt.itemsize > self.size:
            raise AddressError(f"view [{offset}, +{count * dt.itemsize}) outside dmabuf of {self.size} bytes")
        return np.frombuffer(self.mm, dtype=dt, count=count, offset=offset).reshape(shape)

    def contains(self, addr: int, size: int) -> bool:
        return (self.dsp_addr is not None and size >= 0
                and self.dsp_addr <= addr and addr + size <= self.dsp_addr + self.size)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.mm.close()
        except BufferError:
            # numpy views still point at the pages; the mapping goes with them.
            pass
        os.close(self.fd)
        self.fd = -1


# ---------------------------------------------------------------- device side

def open_attached(fd: int, size: int) -> "FileView":
    """Check a dmabuf fd received from a host — a sealed memfd, open for
    reading and writing, at least ``size`` bytes long — and return a view
    that reads and writes it through the fd.  Raises ValueError on anything
    else."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("attached fd is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ValueError("attached fd is not a sealable memfd") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ValueError("attached memfd must be sealed against shrink, grow and further sealing")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise ValueError("attached memfd must be open for reading and writing")
    for seal, name in WRITE_SEALS.items():
        if seals & seal:
            raise ValueError(f"attached memfd is sealed with {name}: cores map every buffer shared and writable")
    fs = _fs_type(fd)
    if fs != TMPFS_MAGIC:
        what = "a hugetlb memfd (MFD_HUGETLB)" if fs == HUGETLBFS_MAGIC else f"on a filesystem of type 0x{fs:x}"
        raise ValueError(f"attached memfd is {what}; cores map only plain shmem memfds")
    if size <= 0 or size > st.st_size:
        raise ValueError(f"attach size {size} but the memfd holds {st.st_size} bytes")
    _try_map(fd, size)
    return FileView(fd, size)


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype, _libc.mmap.argtypes = ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                     ctypes.c_int, ctypes.c_int, ctypes.c_long)
        _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return _libc


def _fs_type(fd: int) -> int:
    """statfs f_type of the fd's filesystem (struct statfs starts with it)."""
    buf = (ctypes.c_long * 16)()
    if _c().fstatfs(fd, buf) != 0:
        raise OSError(ctypes.get_errno(), "fstatfs on the attached fd failed")
    return buf[0] & 0xFFFFFFFF


def _try_map(fd: int, size: int) -> None:
    """Map it as a core will (shared, read-write; no page is touched) and
    unmap: whatever else the kernel refuses is refused at attach, not in a core."""
    libc = _c()
    addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise ValueError(f"attached memfd cannot be mapped shared and writable: {os.strerror(err)}")
    libc.munmap(addr, size)


class FileView:
    """An attached buffer as the device front sees it: bytes read and written
    through its fd (pread/pwrite).  The front touches a few bytes of a buffer
    now and then (a descriptor table, an op library's source, the printf
    header), and a mapping would cost a second fd per buffer (Python's mmap
    keeps a dup of the one it maps)."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("FileView slices are contiguous")
        n = max(0, stop - start)
        data = os.pread(self.fd, n, start) if n else b""
        if len(data) != n:
            raise ValueError(f"read {len(data)} of {n} bytes at {start}")
        return data

    def __setitem__(self, key: slice, data) -> None:
        start, stop, step = key.indices(self.size)
        if step != 1 or stop - start != len(data):
            raise ValueError("FileView slice assignment must keep the length")
        self.write(start, bytes(data))

    def write(self, offset: int, data: bytes) -> None:
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"write [{offset}, +{len(data)}) outside a {self.size}-byte buffer")
        os.pwrite(self.fd, data, offset)

    def close(self) -> None:
        """Nothing to unmap; the fd belongs to whoever opened the view."""


@dataclass
class Region:
    """One mapped range of a connection's DSP address space."""

    buf_id: int
    addr: int
    size: int
    mm: object = None  # mmap.mmap (cores) or FileView (the front)
    kind: str = "dmabuf"

    def end(self) -> int:
        return self.addr + self.size


def in_range(addr: int, size: int, base: int, limit: int) -> bool:
    """[addr, addr+size) inside [base, limit), with the 64-bit wire values
    checked so no wrapped sum can pass."""
    return (0 <= addr < U64 and 0 <= size < U64 and addr + size < U64
            and base <= addr and addr + size <= limit)


class AddressSpace:
    """The DSP addresses one connection may name: its attached buffers (and
    the KV region inside its staging buffer)."""

    def __init__(self):
        self.regions: dict[int, Region] = {}  # by addr

    def add(self, region: Region) -> None:
        self.regions[region.addr] = region

    def remove(self, addr: int) -> Region:
        return self.regions.pop(addr)

    def find(self, addr: int, size: int) -> Region:
        for r in self.regions.values():
            if in_range(addr, size, r.addr, r.end()):
                return r
        raise AddressError(f"range 0x{addr:x}+{size} is not inside any buffer of this connection")

    def view(self, addr: int, size: int) -> memoryview:
        r = self.find(addr, size)
        off = addr - r.addr
        return memoryview(r.mm)[off:off + size]
