"""libdspx's host-side bounds (src/dspx/sdk/host/c7x_client.c), against a
real device: c7x_client_create_input hands out tensors inside input_buf
exactly up to its capacity — a tensor that ends at the last byte succeeds, one
byte more is -EFBIG, also after a first tensor and its 64-byte alignment —
and a shape whose bit count overflows 64 bits is -EFBIG, not a small tensor.
c7x_client_infer places copied inputs the same way, and an input size that
wraps the 64-bit sum is -EFBIG, not a copy past the buffer.  Expected
offsets and codes are written out by hand from docs/c-api.md."""
from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from dspx.sdk import libdspx

BOUNDS = r"""
#include <c7x_client.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* bounds RESERVE BITS:COUNT...: reserve_io(RESERVE, 4096), then one 1-D
 * create_input per argument (uint8 for 8 bits, else float); prints each
 * one's rc, offset from the first tensor and size, after filling it.
 * infer:SIZE: an INFER of a 64-byte input and one of SIZE bytes (its rc). */
int main(int argc, char **argv) {
    c7x_client_t *c;
    int rc = c7x_client_open(&c, NULL);
    printf("open %d\n", rc);
    if (rc) return 1;
    rc = c7x_client_reserve_io(c, strtoull(argv[1], NULL, 0), 4096);
    printf("reserve %d\ncapacity %zu\noffset %zu\n", rc, c7x_client_input_capacity(c),
           c7x_client_get_input_data_offset(c));
    const char *first = NULL;
    for (int i = 2; i < argc; i++) {
        if (strncmp(argv[i], "infer:", 6) == 0) { /* an input of that data_size, from outside input_buf */
            static uint8_t elsewhere[1 << 16]; /* more than any size that fits */
            c7x_tensor_desc_t in[2], out[1];
            memset(in, 0, sizeof in);
            in[0].data = in[1].data = elsewhere;
            in[0].data_size = 64;
            in[1].data_size = (size_t)strtoull(argv[i] + 6, NULL, 0);
            in[0].ndim = in[1].ndim = 1;
            in[0].dtype_bits = in[1].dtype_bits = 8;
            in[0].dtype_code = in[1].dtype_code = 1;
            in[0].shape[0] = 64;
            in[1].shape[0] = (int64_t)in[1].data_size;
            printf("t%d %d -1 0\n", i - 2, c7x_client_infer(c, 1, 0, in, 2, out, 1, 0, NULL));
            continue;
        }
        int bits = atoi(argv[i]);
        int64_t shape[1] = {strtoll(strchr(argv[i], ':') + 1, NULL, 0)};
        c7x_tensor_desc_t t;
        memset(&t, 0, sizeof t);
        rc = c7x_client_create_input(c, 1, shape, bits == 8 ? 1 : 2, bits, &t);
        if (rc == 0 && first == NULL) first = t.data;
        if (rc == 0) memset(t.data, 0xA5, t.data_size); /* a tensor past the mapping faults here */
        printf("t%d %d %lld %zu\n", i - 2, rc, rc ? -1LL : (long long)((const char *)t.data - first),
               rc ? (size_t)0 : t.data_size);
    }
    c7x_client_close(c);
    return 0;
}
"""

CAP = 3 * 4096  # a multiple of the page: the buffer holds exactly what was reserved
EFBIG, EINVAL = -errno.EFBIG, -errno.EINVAL


@pytest.fixture(scope="module")
def bounds(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bounds")
    (d / "bounds.c").write_text(BOUNDS)
    return libdspx.compile_program([d / "bounds.c"], d / "bounds")


def tensors(binary: Path, device, *specs: str) -> list[tuple[int, int, int]]:
    env = {**os.environ, "DSPX_SOCKET": device.path}
    p = subprocess.run([str(binary), str(CAP), *specs], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert (lines["open"], lines["reserve"], lines["capacity"], lines["offset"]) == ("0", "0", str(CAP), "0")
    return [tuple(map(int, lines[f"t{i}"].split())) for i in range(len(specs))]


@pytest.mark.parametrize("specs, want", [
    (["8:12288"], [(0, 0, CAP)]),  # exactly the capacity
    (["8:12289"], [(EFBIG, -1, 0)]),  # one byte over
    (["8:12288", "8:1"], [(0, 0, CAP), (EFBIG, -1, 0)]),  # full: not one more byte
    (["8:12288", "8:0"], [(0, 0, CAP), (0, CAP, 0)]),  # an empty tensor at the very end
    (["8:100", "8:12160"], [(0, 0, 100), (0, 128, CAP - 128)]),  # after the first, 64-aligned: fits to the end
    (["8:100", "8:12161"], [(0, 0, 100), (EFBIG, -1, 0)]),  # ... one byte more
    (["32:3056", "32:16"], [(0, 0, CAP - 64), (0, CAP - 64, 64)]),
    (["32:3056", "8:65"], [(0, 0, CAP - 64), (EFBIG, -1, 0)]),
])
def test_create_input_at_capacity_and_one_byte_over(bounds, shared_device, specs, want):
    assert tensors(bounds, shared_device, *specs) == want


@pytest.mark.parametrize("spec, rc", [
    ("64:288230376151711744", EFBIG),  # 2^58 float64: 2^61 bytes (2^58 * 64 bits wraps to 0 in 64 bits)
    ("32:576460752303423488", EFBIG),  # 2^59 float32: the same
    ("8:1152921504606846976", EINVAL),  # 2^60 elements: over the extent libdspx accepts
])
def test_create_input_of_a_shape_whose_bits_overflow_is_refused(bounds, shared_device, spec, rc):
    assert tensors(bounds, shared_device, spec, "8:64") == [(rc, -1, 0), (0, 0, 64)]


@pytest.mark.parametrize("size, rc", [
    # the descriptor region (80 bytes per input, 64-aligned: 192) comes first, then 64 bytes, then this one
    (CAP - 256, -errno.EBADF),  # fits to the last byte: sent; the device has no module 1
    (CAP - 255, EFBIG),  # one byte over: refused on the host
    ((1 << 64) - 32, EFBIG),  # 64-aligned offset + size wraps 64 bits to a small end
])
def test_infer_inputs_at_capacity_and_a_size_that_wraps(bounds, shared_device, size, rc):
    assert tensors(bounds, shared_device, f"infer:{size}") == [(rc, -1, 0)]


# ---------------------------------------------------------------- c7x::Module::Run (c7x_runtime.cc)
RUN_SHAPES = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "c7x_runtime.h"

/* run_shapes SO RESERVE BITS:D0,D1,...: load SO, reserve_io(RESERVE, 64 KiB),
 * then one Run per argument with a single uint8 (8 bits) or float input of
 * that shape, its data outside input_buf (copied); prints each one's
 * "code status status_name".  The data is never read past what fits. */
int main(int argc, char** argv) {
  static uint8_t elsewhere[1 << 16];
  c7x::Module m;
  m.Load(argv[1]);
  m.ReserveIO(std::strtoull(argv[2], nullptr, 0), 1 << 16);
  for (int i = 3; i < argc; i++) {
    int bits = std::atoi(argv[i]);
    std::vector<int64_t> shape;
    for (char* p = std::strchr(argv[i], ':'); p && *p; p = std::strchr(p + 1, ','))
      shape.push_back(std::strtoll(p + 1, nullptr, 0));
    DLTensor t{elsewhere, {kDLCPU, 0}, static_cast<int32_t>(shape.size()),
               {static_cast<uint8_t>(bits == 8 ? kDLUInt : kDLFloat), static_cast<uint8_t>(bits), 1}, shape.data(),
               nullptr, 0};
    try {
      m.Run({t});
      std::printf("r%d 0 0 ok\n", i - 3);
    } catch (const c7x::Error& e) {
      std::printf("r%d %d %d %s\n", i - 3, e.code(), e.status(), e.status_name().c_str());
      std::fprintf(stderr, "r%d %s\n", i - 3, e.what());
    }
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def run_shapes(tmp_path_factory, compiled) -> tuple[Path, Path]:
    """The program, and multi_output's model.so alone in a directory (no
    metadata.json: its io_reserve would replace the test's reservation)."""
    d = tmp_path_factory.mktemp("run_shapes")
    (d / "run_shapes.cc").write_text(RUN_SHAPES)
    (d / "bare").mkdir()
    so = d / "bare" / "model.so"
    so.write_bytes((compiled("multi_output") / "model.so").read_bytes())
    return libdspx.compile_program([d / "run_shapes.cc"], d / "run_shapes"), so


SENT = "sent"  # the host let it through: the device's own status came back (the shape is not the module's)


@pytest.mark.parametrize("spec, want", [
    # the module has 1 input: its 80-byte descriptor region rounds to 128, the copy goes after it
    ("8:12160", SENT),  # exactly what fits: CAP - 128 bytes
    ("8:12161", (EFBIG, "EFBIG")),  # one byte past
    ("32:4,760", SENT),  # the same fit in float32
    ("64:288230376151711744", (EFBIG, "EFBIG")),  # 2^58 float64: 2^61 bytes (the bit count 2^64 wraps to 0)
    ("8:1152921504606846975", (EFBIG, "EFBIG")),  # 2^60 - 1 elements: the guard's last count
    ("8:1152921504606846976", (EINVAL, "EINVAL")),  # 2^60 elements: one past it
    ("32:4294967296,4294967296", (EINVAL, "EINVAL")),  # 2^64 elements: the product wraps to 0
    ("32:3,-1,64", (EINVAL, "EINVAL")),  # a negative extent
    ("32:0,1099511627776,1099511627776", SENT),  # no elements: 0 bytes, however big the rest
])
def test_cxx_module_run_shape_bytes_at_the_fit_one_past_and_huge(run_shapes, shared_device, spec, want):
    exe, so = run_shapes
    env = {**os.environ, "DSPX_SOCKET": shared_device.path}
    p = subprocess.run([str(exe), str(so), str(CAP), spec], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    code, status, name = p.stdout.split()[1:]
    if want == SENT:
        assert int(status) < 0, p.stdout + p.stderr
    else:
        assert (int(code), int(status), name) == (want[0], 0, want[1]), p.stdout + p.stderr
        if want[0] == EINVAL:
            assert "bad shape [" in p.stderr, p.stderr
