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
