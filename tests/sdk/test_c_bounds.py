"""Bounds of the C code at their edges (issue 29): exact fit, one past, and
negative strides.  The expected figures are written out by hand (or numpy),
not taken from the code under test.

* dspx/ivp.h: a full-vector load near a page end goes through the runtime;
  vector tails of 0..15 floats that end where an unmapped page begins must
  not fault (the seed's vecmul reads one whole vector past the end).
* runtime.c: the auto-increment DMA range check with negative strides, on
  the source and on the destination; the IDMA queue holds 64 copies.
* c7x_client.c: ``c7x_client_create_input`` at exactly the capacity and one
  byte over.

A fault must fail a named test, not end pytest: the page-end loads run in a
child process."""
from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspx.abi.protocol import Status
from dspx.memory import Region
from dspx.sdk import libdspx

from test_c_api import compile_src, run
from test_native_ops import BUF, DATA_ADDR, OUT_ADDR, Dev, autoinc, build, sdk_ops  # noqa: F401  (sdk_ops: a fixture)

HERE = Path(__file__).resolve().parent
PAGE = 4096

# ------------------------------------------------------------------ vector tails at a page end

# Runs in a child: the firmware softmax (cmd 0x1402, the seed's vector code
# over dspx/ivp.h) on n = 64 + tail floats whose input and output each end
# where a PROT_NONE page begins.  One line per size, as it finishes.
PAGE_END_CHILD = r"""
import ctypes, mmap, struct, sys
import numpy as np
from dspx.device.core import runtime as rt
from dspx.memory import Region
from test_native_ops import ARGS_ADDR, DATA_ADDR, OUT_ADDR, Dev

libc = ctypes.CDLL(None)
for tail in range(16):
    n = 64 + tail
    d = Dev(data_size=4096, out_size=4096)
    keep = []
    for addr in (DATA_ADDR, OUT_ADDR):
        big = mmap.mmap(-1, 2 * 4096)
        base = np.frombuffer(big, np.uint8).ctypes.data
        assert libc.mprotect(ctypes.c_void_p(base + 4096), 4096, 0) == 0
        view = memoryview(big)[4096 - 4 * n:4096]
        d.space.remove(addr)
        d.space.add(Region(9, addr, 4 * n, view))
        d.mm[addr] = view
        keep.append(big)
    x = np.frombuffer(d.mm[DATA_ADDR], np.float32)
    x[:] = np.float32(1) + np.arange(n, dtype=np.float32) / np.float32(n)
    e = np.exp(x.astype(np.float64) - x.max())
    ref = e / e.sum()
    for tcm in (0, 1):
        struct.pack_into("<i4xQB", d.mm[ARGS_ADDR], 0, 4 * n, DATA_ADDR, tcm)
        r = d.reg.run(0x1402, d.args[:24], np.frombuffer(d.mm[OUT_ADDR], np.uint8), rt.TaskContext(d.space, d.core))
        got = np.frombuffer(d.mm[OUT_ADDR], np.float32)
        print(tail, tcm, r.status, float(np.max(np.abs(got - ref) / ref)), flush=True)
    d.close()
"""


def test_vector_tails_of_0_to_15_floats_ending_at_a_page_end_do_not_fault():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(HERE), str(HERE.parent)]))
    p = subprocess.run([sys.executable, "-c", PAGE_END_CHILD], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln.split() for ln in p.stdout.splitlines()]
    assert p.returncode == 0, f"the child ended with {p.returncode} after {len(lines)} of 32 runs: {p.stderr[-2000:]}"
    assert [(int(t), int(tcm)) for t, tcm, *_ in lines] == [(t, tcm) for t in range(16) for tcm in (0, 1)]
    for tail, tcm, status, err in lines:
        assert int(status) == 0 and float(err) <= 1e-6, (tail, tcm, status, err)


# ------------------------------------------------------------------ auto-increment DMA, negative strides

@pytest.fixture
def guarded_dev(sdk_ops):  # noqa: F811
    """A Dev whose data and output buffers each start 4 KiB into a mapping
    of 0xEE bytes: a copy that strays before a buffer touches memory that is
    mapped (and shows it) instead of faulting or hitting the test's own."""
    d = Dev(sdk_ops)
    d.guard = []  # the 4 KiB before each buffer
    for i, addr in enumerate((DATA_ADDR, OUT_ADDR)):
        big = mmap.mmap(-1, PAGE + BUF)
        big[:PAGE] = b"\xee" * PAGE
        view = memoryview(big)[PAGE:]
        d.space.remove(addr)
        d.space.add(Region(9 + i, addr, BUF, view))
        d.mm[addr] = view
        d.guard.append(np.frombuffer(big, np.uint8)[:PAGE])
    d.data, d.out = np.frombuffer(d.mm[DATA_ADDR], np.uint8), np.frombuffer(d.mm[OUT_ADDR], np.uint8)
    yield d
    d.close()


def test_autoinc_source_rows_walking_back_to_the_buffers_first_byte_fit(guarded_dev):
    d = guarded_dev
    rows = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    d.data[:rows.size] = rows.ravel()
    # from row 3 (offset 192) back to row 0: exactly the buffer's first 256 bytes
    r = autoinc(d, 192, 3, [64, 4, 1, 1], [-64, 0, 0], [64, 4, 1, 1], [64, 0, 0], 256)
    assert (r.status, r.return_value) == (0, 1), r.printf
    assert np.array_equal(d.out[:256].reshape(4, 64), rows[::-1])


@pytest.mark.parametrize("src_off", [191, 0])  # one byte before the buffer; 192 bytes before (issue 29)
def test_autoinc_source_rows_walking_back_past_the_buffer_are_err_invalid(guarded_dev, src_off):
    d = guarded_dev
    d.out[:256] = 0
    r = autoinc(d, src_off, 3, [64, 4, 1, 1], [-64, 0, 0], [64, 4, 1, 1], [64, 0, 0], 256)
    assert r.status == r.return_value == Status.ERR_INVALID, r.printf
    assert "DmaError" in r.printf and "source" in r.printf and "not inside the task's buffers" in r.printf
    assert not d.out[:256].any()  # nothing copied, the 0xEE bytes before the buffer least of all


def test_autoinc_destination_rows_walking_back_before_the_output_are_err_invalid(guarded_dev):
    # the destination starts at the output's first byte; a negative ddim1 walks before it
    r = autoinc(guarded_dev, 0, 3, [64, 4, 1, 1], [64, 0, 0], [64, 4, 1, 1], [-64, 0, 0], 256)
    assert r.status == r.return_value == Status.ERR_INVALID, r.printf
    assert "destination" in r.printf and "not inside the task's buffers" in r.printf
    assert (guarded_dev.guard[1] == 0xEE).all()  # nothing written before the output


# ------------------------------------------------------------------ the IDMA queue: 64 copies

QUEUE_OP = r"""
#include <dspx/dsp.h>
/* 66 copies of 64 bytes on channel 0 with no wait in between; the output
 * gets each IDMA_COPY's return value (int32), then the channel is waited for. */
static int op_queue(void *input, void *output, void *tm) {
    (void)input; (void)tm;
    int32_t *rcs = output, ret = 0;
    uint8_t *src = (uint8_t *)output + 4096;
    for (int k = 0; k < 66; k++) {
        IDMA_COPY(HB_IDMA_CH0, ret, src, src + 64, 64)
        rcs[k] = ret;
    }
    IDMA_WAIT(HB_IDMA_CH0, ret)
    return ret;
}
int dspx_ops_init(void) { return hb_dsp_register_fn(0x6101, op_queue, 0); }
"""


def test_idma_queues_64_copies_and_refuses_the_65th(tmp_path):
    d = Dev(build(tmp_path, "queue.c", QUEUE_OP))
    try:
        r = d.run(0x6101, out_size=8192)
        rcs = np.frombuffer(d.out[:4 * 66].tobytes(), np.int32)
        assert list(rcs[:64]) == list(range(64)), r.printf  # tickets 0..63
        assert list(rcs[64:]) == [Status.ERR_INVALID] * 2, r.printf
        assert "DMA channel 0 has 64 copies not waited for (the most it queues)" in r.printf
    finally:
        d.close()


# ------------------------------------------------------------------ c7x_client_create_input capacity

CREATE_INPUT_DRIVER = r"""
#include <c7x_client.h>
#include <stdio.h>
#include <string.h>

static c7x_tensor_desc_t first;
static void try_bytes(c7x_client_t *c, const char *key, int64_t n) {
    c7x_tensor_desc_t t;
    memset(&t, 0, sizeof t);
    int rc = c7x_client_create_input(c, 1, &n, 1, 8, &t); /* uint8 [n] */
    printf("%s_rc %d\n", key, rc);
    if (rc == 0) {
        if (!first.data) first = t;
        printf("%s_off %td\n", key, (char *)t.data - (char *)first.data);
        memset(t.data, 0x5a, (size_t)n); /* every byte it handed out is ours to write */
    }
}

int main(void) {
    c7x_client_t *c;
    if (c7x_client_open_ex(&c, NULL)) {
        printf("open_error %s\n", c7x_client_open_error());
        return 1;
    }
    printf("reserve_rc %d\n", c7x_client_reserve_io(c, 4096, 64));
    size_t cap = c7x_client_input_capacity(c);
    printf("capacity %zu\ndata_offset %zu\n", cap, c7x_client_get_input_data_offset(c));
    try_bytes(c, "a", 64);                        /* [0, 64) */
    try_bytes(c, "over", (int64_t)(cap - 64 + 1)); /* one byte past the capacity */
    try_bytes(c, "fit", (int64_t)(cap - 64));      /* [64, cap): exactly the capacity */
    try_bytes(c, "full", 1);                       /* nothing left */
    try_bytes(c, "bigger", (int64_t)cap + 1);      /* bigger than the whole buffer */
    c7x_client_close(c);
    return 0;
}
"""


@pytest.fixture(scope="module")
def create_input_driver(tmp_path_factory) -> Path:
    libdspx.build()
    return compile_src(tmp_path_factory.mktemp("bounds"), "create_input.c", CREATE_INPUT_DRIVER)


def test_create_input_at_exactly_the_capacity_and_one_byte_over(create_input_driver, shared_device):
    r = run(create_input_driver, socket_path=shared_device.path)
    assert r.proc.returncode == 0, r.proc.stdout + r.proc.stderr
    assert r.rc("reserve") == 0 and int(r["capacity"]) >= 4096 and r["data_offset"] == "0"
    assert (r.rc("a"), r["a_off"]) == (0, "0")
    assert r.rc("over") == -errno.EFBIG
    assert (r.rc("fit"), r["fit_off"]) == (0, "64")
    assert r.rc("full") == -errno.EFBIG
    assert r.rc("bigger") == -errno.EFBIG
