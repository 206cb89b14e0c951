"""A missing optional dependency is named as the extra to install, in the
CLI's words (``dspx.errors.MissingExtra``), by the Python API and by the
device's cores (ERR_LOAD with one line, not a worker's traceback); and
``dir(dspx)`` lists the main API while ``import dspx`` stays light.
Installs without an extra are simulated: ``sys.modules[name] = None``
(a sitecustomize on PYTHONPATH for the device's processes)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import SMALL, Device
from dspx.errors import DeviceError, MissingExtra

HINT = "needs the 'tvm' extra ({module} is not installed): pip install 'dspx[tvm]'"


def _python(code: str, tmp_path, hide: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if hide:
        site = tmp_path / f"no-{hide}"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{hide!r}] = None\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    env.pop("DSPX_SOCKET", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)


@pytest.mark.parametrize("hide", ["onnx", "tvm"])
def test_inference_session_without_the_tvm_extra_names_it(example_onnx, tmp_path, hide):
    r = _python(f"""
        import dspx
        try:
            dspx.InferenceSession({str(example_onnx['multi_output'])!r}, cache_dir={str(tmp_path / 'c')!r})
        except dspx.MissingExtra as e:
            print(type(e).__name__, e.extra, e.module, "|", e)
    """, tmp_path, hide)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"MissingExtra tvm {hide} | dspx.InferenceSession on an .onnx file " \
                               + HINT.format(module=hide), r.stdout


def test_the_cli_names_it_in_the_same_words(example_onnx, tmp_path):
    r = _python(f"""
        import sys
        from dspx.cli import main
        sys.argv = ["dspx", "compile", {str(example_onnx['multi_output'])!r}, "-o", "out"]
        main()
    """, tmp_path, "onnx")
    assert r.returncode == 1 and r.stderr.strip() == "error: `dspx compile` " + HINT.format(module="onnx"), r.stderr


@pytest.fixture(scope="module")
def device_without_tvm(tmp_path_factory):
    site = tmp_path_factory.mktemp("no-tvm-device")
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['tvm'] = None\n")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), saved) if p)
    try:
        d = Device(*SMALL)
    finally:
        os.environ.pop("PYTHONPATH")
        if saved is not None:
            os.environ["PYTHONPATH"] = saved
    yield d
    d.stop()


def test_a_device_without_tvm_says_which_extra_in_one_line(device_without_tvm, compiled, client_of):
    import dspx

    with pytest.raises(MissingExtra) as e:
        dspx.VirtualMachine(compiled("multi_output"), client=client_of(device_without_tvm.path))
    err = e.value
    assert isinstance(err, DeviceError) and err.status_name == "ERR_LOAD" and err.request == "DYN_LOAD"
    assert (err.extra, err.module) == ("tvm", "tvm")
    assert str(err) == "the device (ERR_LOAD on DYN_LOAD) " + HINT.format(module="tvm")
    assert "Traceback" not in err.detail and "\n" not in err.detail
    assert err.detail == "loading a compiled module on the device " + HINT.format(module="tvm")
    # the LLM's path (dspx generate --model) loads its modules the same way
    c = client_of(device_without_tvm.path)
    with pytest.raises(MissingExtra, match=r"pip install 'dspx\[tvm\]'"):
        c.load_module((compiled("multi_output") / "model.so").read_bytes())
    assert device_without_tvm.alive() and c.ping()


def test_dspx_run_on_that_device_is_one_line(device_without_tvm, compiled, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 32), np.float32))
    r = subprocess.run([sys.executable, "-m", "dspx.cli", "run", str(compiled("multi_output")), "-i",
                        str(tmp_path / "x.npy"), "--socket", device_without_tvm.path],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: the device (ERR_LOAD on DYN_LOAD) " + HINT.format(module="tvm"), r.stderr


def test_dspx_generate_on_that_device_is_one_line(device_without_tvm):
    from dspx.compiler.llm import compiled_dir

    package = compiled_dir(progress=False)  # the tests' cached SmolLM2 package
    r = subprocess.run([sys.executable, "-m", "dspx.cli", "generate", "hi", "-n", "1", "--model", str(package),
                        "--socket", device_without_tvm.path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == "error: the device (ERR_LOAD on DYN_LOAD) " + HINT.format(module="tvm"), r.stderr


def test_dir_lists_the_main_api_and_import_stays_light(tmp_path):
    r = _python("""
        import sys
        import dspx
        names = dir(dspx)
        print(sorted(m for m in sys.modules if m.startswith("dspx.host") or m in ("tvm", "onnx", "onnxruntime")))
        print(" ".join(n for n in dspx.__all__ if n not in names))
        print(" ".join(n for n in dspx.__all__ if getattr(dspx, n, None) is None))
        print(dspx.Tasks.__module__, dspx.SessionOptions.__module__)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    loaded, not_listed, missing, modules = r.stdout.splitlines()
    assert loaded == "[]"  # import dspx loads no host code and no heavy package
    assert not_listed == "" and missing == ""
    assert modules == "dspx.host.tasks dspx.host.onnxrt"
    import dspx
    for name in ("Client", "VirtualMachine", "InferenceSession", "SessionOptions", "IOBinding", "Tasks",
                 "DspxError", "DeviceError", "InputError", "MissingExtra", "OpFailed"):
        assert name in dir(dspx) and name in dspx.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        dspx.Nope


def test_every_extra_is_in_the_readme_and_in_all():
    """The extras a MissingExtra can name, the README's table and `all` agree."""
    import re
    import tomllib
    from pathlib import Path

    from dspx.errors import EXTRA_OF

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    in_all = set(re.fullmatch(r"dspx\[(.*)\]", extras["all"][0]).group(1).split(","))
    user_extras = set(extras) - {"all", "test"}
    # torch: 0.75 GB, not needed at run time; farm: Ray, for clusters of devices
    assert in_all == user_extras - {"torch", "farm"}
    assert "plot" in in_all and set(EXTRA_OF.values()) <= user_extras
    table = set(re.findall(r"^\| `(\w+)` \|", (root / "README.md").read_text(), re.M))
    assert user_extras | {"all"} <= table
