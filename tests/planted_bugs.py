"""Plant bugs one at a time in a scratch copy of the repo and run the named
tests that should catch each; prints one line per bug and the tests that
caught it.

    python tests/planted_bugs.py [N ...]     # all, or bugs N ...

First the clean copy runs every named test of the chosen bugs: that
baseline must pass, or nothing is planted (a test that is red already
would "catch" anything).  A bug then counts as caught only when one of its
own named tests (file::test, any parameter) FAILS; an error in a fixture, a
crash of pytest or a failure of some other test does not count.  The
planted builds (the C shim, libdspx) go to a cache inside the scratch copy,
seeded from $DSPX_CACHE, never to a shared one.

Issue 18's eight bugs, issue 29's three C and three Python bugs, three
more C bugs at bounds of the C code, and issue 29's last three fixes undone
(the C++ shape product, a reply's descriptor table, a closed connection's
op libraries).  Not part of `make test` (it runs device
tests over and over); the last result is in docs/testing.md, "Planted bugs"."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
RUN_TIMEOUT_S = 900
BOUNDS = "tests/sdk/test_c_bounds.py::"
PAGE_END = BOUNDS + "test_vector_tails_of_0_to_15_floats_ending_at_a_page_end_do_not_fault"

# (name, file, the text replaced, the planted text, the tests that must catch it)
BUGS = [
 # ---- issue 18
 ("overflow-unsafe end in the address range check", "src/dspx/memory.py",
  "    return (0 <= addr < U64 and 0 <= size < U64 and addr + size < U64\n"
  "            and base <= addr and addr + size <= limit)",
  "    return base <= addr and (addr + size) % U64 <= limit  # planted: the end wraps",
  ["tests/device/front/test_handlers.py::test_infer_input_range_that_wraps_64_bits_is_err_addr"]),
 ("capacity locked before the request instead of after success", "src/dspx/host/session.py",
  '        if not large:\n            return InferLayout(copies, b""',
  '        self.locked = True  # planted\n        if not large:\n            return InferLayout(copies, b""',
  ["tests/host/test_session.py::test_planning_an_inference_does_not_lock_only_its_success_does"]),
 ("KV-resident outputs written at the wrong offset", "src/dspx/device/core/inference.py",
  "dst = view(self.kv_mm, kv_off + kpos, arr.shape, arr.dtype)",
  "dst = view(self.kv_mm, kv_off + kpos + 64, arr.shape, arr.dtype)",
  ["tests/device/core/test_inference.py::test_kv_resident_outputs_are_packed_from_the_kv_regions_base"]),
 ("INFER_LARGE skips the reserved-flags check", "src/dspx/device/front/handlers/calls.py",
  "        if req.flags & P.INFER_FLAGS_RESERVED:",
  "        if req.TYPE == P.MsgType.INFER and req.flags & P.INFER_FLAGS_RESERVED:",
  ["tests/device/front/test_handlers.py::test_infer_large_reserved_flag_bits_are_invalid"]),
 ("tile manager's fit check ignores alignment padding", "src/dspx/device/core/runtime.py",
  "            if start + nbytes <= off + size:",
  "            if off + nbytes <= off + size:",
  ["tests/device/core/test_tiles_and_dma.py::test_a_tile_fits_only_if_its_alignment_padding_fits_too"]),
 ("BUF_DETACH of a buffer a running job uses: ERR_BUSY guard removed", "src/dspx/device/front/handlers/buffers.py",
  "        if b.busy:\n",
  "        if False:  # planted\n",
  ["tests/device/front/test_handlers.py::test_detach_of_a_buffer_a_job_uses_is_busy",
   "tests/device/front/test_service.py::test_detach_of_a_buffer_a_running_job_uses_is_busy"]),
 ("the RPC message's fields permuted on the wire", "src/dspx/abi/protocol.py",
  '"cmd core priority timeout_ms input_dsp_addr input_size output_dsp_addr output_size"',
  '"cmd core priority timeout_ms output_dsp_addr output_size input_dsp_addr input_size"',
  ["tests/abi/test_protocol.py::test_layout_against_spec"]),
 ("the loader's forked probe turned off", "src/dspx/device/core/worker.py",
  'if os.environ.get(LOAD_PROBE_ENV, "1") != "0":',
  'if os.environ.get(LOAD_PROBE_ENV, "0") != "0":  # planted',
  ["tests/device/core/test_loader.py::test_a_module_that_crashes_the_loader_costs_the_probe_child_not_the_core"]),
 # ---- issue 29: the C survivors
 ("ivp.h: the aligning load's page-end guard counts lanes as bytes", "src/dspx/sdk/include/dspx/ivp.h",
  "    if (__builtin_expect(off == 0 || off > 4096 - 64, 0))",
  "    if (__builtin_expect(off == 0 || off > 4096 - IVP_N, 0))",
  [PAGE_END]),
 ("runtime.c: the auto-increment DMA range check ignores negative strides", "src/dspx/sdk/dsp/runtime.c",
  "        if (span < 0)\n            lo += span;\n        else\n            hi += span;\n",
  "        if (span > 0)\n            hi += span;\n",
  [BOUNDS + "test_autoinc_source_rows_walking_back_past_the_buffer_are_err_invalid",
   BOUNDS + "test_autoinc_destination_rows_walking_back_before_the_output_are_err_invalid"]),
 ("c7x_client.c: create_input bound off > size instead of off > size - nbytes", "src/dspx/sdk/host/c7x_client.c",
  "off > c->input_buf.size - (size_t)nbytes)",
  "off > c->input_buf.size)",
  [BOUNDS + "test_create_input_at_exactly_the_capacity_and_one_byte_over"]),
 # ---- issue 29: the Python survivors
 ("quantize.py: the calibration range no longer widened to include 0", "src/dspx/compiler/quantize.py",
  "    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)\n",
  "    lo, hi = float(lo), float(hi)\n",
  ["tests/compiler/test_qparams.py::test_the_calibration_range_is_widened_to_contain_zero"]),
 ("serve_llm.py: a string stop split into its characters", "src/dspx/host/serve_llm.py",
  "        stop = [stop]\n",
  "        stop = list(stop)\n",
  ["tests/llm/test_serve_llm.py::test_a_string_stop_is_one_sequence_not_its_characters"]),
 ("inference.py: profile rows dropped largest first when the printf ring is full", "src/dspx/device/core/inference.py",
  "    for i in sorted(keep, key=lambda i: cycles[i]):",
  "    for i in sorted(keep, key=lambda i: -cycles[i]):",
  ["tests/device/core/test_profile_rows.py::test_the_smallest_rows_are_dropped_first_and_counted"]),
 # ---- three more at the C code's bounds
 ("ivp.h: a full load starting a page (wholly past a buffer's end) not guarded", "src/dspx/sdk/include/dspx/ivp.h",
  "    if (__builtin_expect(off == 0 || off > 4096 - 64, 0))",
  "    if (__builtin_expect(off > 4096 - 64, 0))",
  [PAGE_END]),
 ("runtime.c: the IDMA queue takes a 65th copy over the oldest slot", "src/dspx/sdk/dsp/runtime.c",
  "    if (ch->submitted - ch->waited >= QCAP) {",
  "    if (ch->submitted - ch->waited > QCAP) {",
  [BOUNDS + "test_idma_queues_64_copies_and_refuses_the_65th"]),
 ("c7x_client.c: create_input's nbytes > size guard dropped (size - nbytes wraps)", "src/dspx/sdk/host/c7x_client.c",
  "    if ((uint64_t)nbytes > c->input_buf.size || off > c->input_buf.size - (size_t)nbytes)",
  "    if (off > c->input_buf.size - (size_t)nbytes)",
  [BOUNDS + "test_create_input_at_exactly_the_capacity_and_one_byte_over",
   "tests/sdk/test_c_api.py::test_capacity_efbig_err_size_and_lock"]),
 # ---- issue 29's last fixes: the C++ shape product, a reply's table, op libraries of a closed connection
 ("c7x_runtime.cc: Run's input byte count is the unchecked product of the shape", "src/dspx/sdk/host/c7x_runtime.cc",
  "    int64_t nbytes = dspx_shape_bytes(t->ndim, t->shape, t->dtype.bits);\n",
  "    uint64_t n = 1;  // planted: no guard, the product wraps\n"
  "    for (int k = 0; k < t->ndim; k++) n *= static_cast<uint64_t>(t->shape[k]);\n"
  "    int64_t nbytes = static_cast<int64_t>(n * t->dtype.bits / 8);\n",
  ["tests/sdk/test_c_client_edges.py::test_cxx_module_run_shape_bytes_at_the_fit_one_past_and_huge"]),
 ("client.py: an INFER reply's descriptor table read wherever descs_addr points", "src/dspx/host/client.py",
  "    if r.descs_size < need or not ob.contains(r.descs_addr, r.descs_size):",
  "    if r.descs_size < need:",
  ["tests/host/test_client.py::test_a_forged_output_table_is_a_bad_reply_naming_the_numbers"]),
 ("connections.py: a closing connection's own op libraries are kept (nobody may unload them)",
  "src/dspx/device/front/connections.py",
  "        for handle in list(conn.oplibs):\n            actions += h.unload_ops(self.st.modules[handle])\n",
  "",
  ["tests/device/front/test_service.py::test_an_op_library_goes_with_its_connection_and_a_device_wide_one_stays"]),
]

#: cache areas the scratch copy starts from (the big data sets are left out)
CACHE_AREAS = ("sdk", "modules", "onnx", "onnx-backend", "quantize", "llm")


def scratch() -> str:
    """A copy of the working tree (without .venv, .git and the LLM cache),
    with a build cache of its own."""
    root = tempfile.mkdtemp(prefix="dspx-planted-")
    subprocess.run(f"tar --exclude=./.venv --exclude=./.git --exclude=./mutants --exclude=./.cache/dspx/llm -cf - . "
                   f"| tar -xf - -C {root}", shell=True, cwd=REPO, check=True)
    from_cache = Path(os.environ.get("DSPX_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                          "dspx"))
    for area in CACHE_AREAS:
        if (from_cache / area).is_dir():
            shutil.copytree(from_cache / area, Path(root, ".planted-cache", area), symlinks=True)
    return root


def run_tests(root: str, env: dict, tests: list[str]) -> tuple[int, list[str], list[str], str]:
    """pytest on ``tests``: (exit code, FAILED lines, ERROR lines, last line);
    a line is the test id, then " - " and the start of its message."""
    try:
        r = subprocess.run(["nice", PY, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                           cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, [], [], f"timed out after {RUN_TIMEOUT_S} s"
    lines = r.stdout.splitlines()
    ids = lambda tag: [ln.split(" ", 1)[1] for ln in lines if ln.startswith(tag + " ")]  # noqa: E731
    last = lines[-1] if lines else r.stderr.strip()[-300:]
    if r.returncode < 0:
        last = f"pytest killed by signal {-r.returncode}; {last}"
    return r.returncode, ids("FAILED"), ids("ERROR"), last


def named(line: str, tests: list[str]) -> bool:
    """Whether the test of a FAILED line (its id maybe with [params]) is one of ``tests``."""
    test_id = line.split(" - ")[0]
    return test_id in tests or test_id.split("[")[0] in tests


def short(line: str, width: int = 160) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def main(only: list[int]) -> int:
    chosen = [(i, b) for i, b in enumerate(BUGS, 1) if not only or i in only]
    root = scratch()
    print(f"scratch copy: {root}")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), DSPX_CACHE=os.path.join(root, ".planted-cache"))
    for i, (name, path, old, _new, _tests) in chosen:
        n = Path(root, path).read_text().count(old)
        assert n == 1, f"{i}. {name}: the text to replace is in {path} {n} times, not once"
    baseline = list(dict.fromkeys(t for _, b in chosen for t in b[4]))
    rc, failed, errors, last = run_tests(root, env, baseline)
    print(f"baseline, {len(baseline)} named tests on the clean tree: {'PASS' if rc == 0 else 'FAIL'} ({last})")
    if rc != 0:
        for t in failed + errors:
            print(f"     {short(t)}")
        shutil.rmtree(root, ignore_errors=True)
        return 2
    missed = 0
    for i, (name, path, old, new, tests) in chosen:
        p = Path(root, path)
        orig = p.read_text()
        p.write_text(orig.replace(old, new))
        try:
            rc, failed, errors, last = run_tests(root, env, tests)
        finally:
            p.write_text(orig)
        caught = [t for t in failed if named(t, tests)]
        missed += not caught
        print(f"{i}. {name}: {'CAUGHT' if caught else 'NOT CAUGHT'} ({last})")
        for t in caught[:6]:
            print(f"     caught by {short(t)}")
        for t in [t for t in failed if not named(t, tests)][:3] + errors[:3]:
            print(f"     (does not count) {short(t)}")
        sys.stdout.flush()
    print(f"{len(chosen) - missed} of {len(chosen)} caught")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]]))
