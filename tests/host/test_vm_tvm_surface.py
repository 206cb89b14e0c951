"""VirtualMachine's TVM calls side by side with TVM's own relax.VirtualMachine
on the same compiled model.so (loaded on the host: TVM is the reference):
get_function_arity / get_function_param_name, save_function, set_instrument,
time_evaluator's warm-up and min_repeat_ms, and the profile Report's csv()."""
from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from dspx.errors import DspxError
from dspx.host.vm import VirtualMachine

X = np.random.default_rng(5).standard_normal((2, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def module_dir(compiled):
    return compiled("multi_output")


@pytest.fixture(scope="module")
def tvm_vm(module_dir):
    tvm = pytest.importorskip("tvm")
    from tvm import relax

    return relax.VirtualMachine(tvm.runtime.load_module(str(module_dir / "model.so")), tvm.cpu())


@pytest.fixture
def vm(shared_device, client_of, module_dir):
    with VirtualMachine(module_dir, client=client_of(shared_device.path)) as v:
        yield v


def _jobs(c):
    st = c.status()
    return st["jobs_completed"] + st["jobs_failed"]


def test_function_arity_and_param_names_match_tvm(vm, tvm_vm):
    arity = tvm_vm._get_function_arity("main")  # what TVM's VM reports for the same model.so
    assert vm.get_function_arity("main") == arity
    assert [vm.get_function_param_name("main", i) for i in range(arity)] == \
        [tvm_vm._get_function_param_name("main", i) for i in range(arity)]
    with pytest.raises(ValueError) as theirs:
        tvm_vm._get_function_param_name("main", arity)
    with pytest.raises(ValueError) as ours:
        vm.get_function_param_name("main", arity)
    assert f"Invalid index for main ({arity} out of {arity})" in str(theirs.value) and str(ours.value) in str(theirs.value)
    with pytest.raises(KeyError, match="no function 'nope'"):
        vm.get_function_arity("nope")


def test_save_function_calls_and_times_the_saved_inputs(vm, tvm_vm):
    import tvm

    tvm_vm.save_function("main", "saved", tvm.runtime.tensor(X))
    ref = [t.numpy() for t in tvm_vm["saved"]()]
    vm.save_function("main", "saved", X)
    X2 = X.copy()
    X[...] = 0  # the inputs were taken when saved
    try:
        got = vm["saved"]()
    finally:
        X[...] = X2
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-4)
    vm.save_function("main", "quiet", x=X, include_return=False)
    assert vm["quiet"]() is None
    res = vm.time_evaluator("saved", None, number=2, repeat=2)()
    assert len(res.results) == 2 and all(r > 0 for r in res.results)
    with pytest.raises(DspxError, match="'main' is a function of the module"):
        vm.save_function("main", "main", X)


def test_set_instrument_sees_the_calls_tvm_sees(vm, tvm_vm):
    import tvm
    from collections import Counter

    theirs = []

    def record_tvm(func, symbol, before, ret, *args):
        if before:
            theirs.append((symbol, [tuple(a.shape) for a in args if hasattr(a, "shape")]))
        return 0
    tvm_vm.set_instrument(record_tvm)
    ref = [o.numpy() for o in tvm_vm["main"](tvm.runtime.tensor(X))]
    ours = []
    vm.set_instrument(lambda func, symbol, before, ret, *args: ours.append((symbol, before, func, args)))
    out = vm["main"](X)
    for g, r in zip(out, ref):  # an instrumented call still returns the outputs
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-4)
    # One before and one after per call site, in the order TVM first calls each
    # function, each site's row counting TVM's calls of it.
    assert [b for _, b, _, _ in ours] == [True, False] * (len(ours) // 2)
    symbols = [s for s, b, _, _ in ours if b]
    assert symbols == list(dict.fromkeys(s for s, _ in theirs))
    counts = Counter(s for s, _ in theirs)
    assert all(func.name == s and func.calls == counts[s] for s, _, func, _ in ours)
    shapes = dict(theirs)  # TVM's compiled functions (kind "tvm"): the same tensor shapes
    assert all([a.shape for a in args] == shapes[s] for s, _, func, args in ours if func.kind == "tvm")
    assert any(func.kind == "tvm" for _, _, func, _ in ours)
    vm.set_instrument(lambda *a: 1)  # SKIP_RUN: the device already ran the call
    with pytest.raises(DspxError, match="already ran on the device"):
        vm["main"](X)
    vm.set_instrument(None)
    vm["main"](X)
    assert len(ours) == 2 * len(symbols)  # removed: no more calls


def test_profile_report_csv_like_tvms(vm):
    rep = vm.profile(X)
    rows = list(csv.DictReader(io.StringIO(rep.csv())))
    # TVM's per-call columns, one row per call site, no totals
    assert list(rows[0]) == ["Name", "Duration (us)", "Percent", "Count", "Device", "Argument Shapes", "Kind"]
    assert [r["Name"] for r in rows] == [r.name for r in rep.rows]
    for line, r in zip(rows, rep.rows):
        assert float(line["Duration (us)"]) == pytest.approx(r.cycles / 1000, abs=1e-3)  # 1 cycle = 1 ns
        assert float(line["Percent"]) == pytest.approx(100 * r.cycles / rep.entry_cycles, abs=0.01)
        assert int(line["Count"]) == r.calls and line["Argument Shapes"] == r.shapes.replace(",", ", ")


def test_time_evaluator_discards_the_warm_up_run(vm):
    """TVM runs 1 + number * repeat times and drops the first: one INFER of 7
    runs here, and the device's first run (the cold one) is in no figure."""
    c = vm.client
    before = _jobs(c)
    res = vm.time_evaluator("main", number=3, repeat=2)(X)
    assert _jobs(c) == before + 1
    import re
    runs = [int(x) * 1e-9 for x in re.findall(r"^run \d+: (\d+) cycles$", vm.last_printf, re.M)]
    assert len(runs) == 7
    assert res.results == pytest.approx([np.mean(runs[1:4]), np.mean(runs[4:7])])
    with pytest.raises(ValueError, match="1 \\+ number \\* repeat"):
        vm.time_evaluator("main", number=65535)


def test_time_evaluator_min_repeat_ms_raises_number_as_tvm_does(vm):
    one = vm.time_evaluator("main", number=1, repeat=1)(X).results[0]
    target_ms = 20 * one * 1e3  # a repeat of one run is far shorter than this
    before = _jobs(vm.client)
    res = vm.time_evaluator("main", number=1, repeat=2, min_repeat_ms=target_ms)(X)
    assert len(res.results) == 2 and all(r > 0 for r in res.results)
    assert _jobs(vm.client) > before + 1  # repeats were run again with a larger number
    import re
    last = len(re.findall(r"^run \d+: \d+ cycles$", vm.last_printf, re.M))
    assert last * res.results[-1] * 1e3 >= target_ms * 0.999  # the last repeat lasted min_repeat_ms
