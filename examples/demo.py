"""`make demo`: the main job on the simulated device.

1. start a private simulated device, ping it, show its status;
2. compile ResNet-18 (built here from a fixed seed; cached under .cache/dspx/)
   and run it on the device, checking the result against onnxruntime;
3. run the softmax custom operator without and with ping-pong tiling: the
   host's time, then the estimated J6 cycles on a second private device with
   the timing model on (DSPX_COST_MODEL=j6-vision);
4. compile SmolLM2-135M (cached) and answer a short question on the device,
   the KV cache staying in the device's KV region between tokens.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np

import dspx
from dspx.host.launcher import PrivateDevice
from dspx.host.tasks import SOFTMAX_CMD, Tasks, softmax_param

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "dspx" / "demo"


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def softmax_data(ucp: Tasks, n: int):
    """The seed's input (1 + i/n), a parameter struct and two outputs on ``ucp``."""
    data = ucp.malloc(4 * n)
    data.view(np.float32)[:] = 1 + np.arange(n, dtype=np.float32) / np.float32(n)
    return data, ucp.malloc(24), ucp.malloc(4 * n), ucp.malloc(4 * n)


@contextlib.contextmanager
def cost_model_device(profile: str):
    """A task session on a private device of its own with the timing model on
    (the device reads DSPX_COST_MODEL once, when it starts)."""
    saved = os.environ.get("DSPX_COST_MODEL")
    os.environ["DSPX_COST_MODEL"] = profile
    try:
        dev = PrivateDevice()
    finally:
        if saved is None:
            os.environ.pop("DSPX_COST_MODEL")
        else:
            os.environ["DSPX_COST_MODEL"] = saved
    try:
        with Tasks(socket=dev.path) as ucp:
            yield ucp
    finally:
        dev.stop()


def softmax_estimate(n: int, profile: str = "j6-vision") -> None:
    """The same two calls, counted: the board's cycles as the model estimates them, and where they go."""
    with cost_model_device(profile) as ucp:
        data, param, out, _ = softmax_data(ucp, n)
        costs = {}
        for name, tiled in (("direct", False), ("ping-pong", True)):
            softmax_param(param, data, n, tiled=tiled)
            ucp.run(SOFTMAX_CMD, param, out)
            costs[name] = ucp.last_cost()
    for name, c in costs.items():
        print(f"estimate ({profile}): {name:<9} {c['cycles']:>9,} cycles = compute {c['compute']:,} + DDR stall "
              f"{c['ddr_stall']:,} + DMA wait {c['dma_wait']:,} + overhead {c['overhead']:,}")
    ratio = costs["ping-pong"]["cycles"] / costs["direct"]["cycles"]
    print(f"estimate ({profile}): ping-pong/direct {ratio:.2f} (a model, not a measurement; the seed measured "
          f"direct 7,648,254 and ping-pong 5,154,293 cycles, 0.67, on the J6 board)")


def main() -> int:
    step("device: start, ping, status")
    with dspx.Client(private=True) as dev:  # a device of its own, gone when the demo ends (docs/device.md)
        print(f"private simulated device on {dev.socket_path}")
        rtts = sorted(dev.ping()["rtt_us"] for _ in range(200))
        st = dev.status()
        print(f"protocol {st['version']}, ping median {rtts[100]:.0f} µs")
        pools = dev.pools()
        print(f"carveout {pools['carveout_total'] >> 20} MiB, DDR pool {pools['ddr_total'] >> 20} MiB, "
              f"{pools['cores']} core(s); staging is attached on the first call that needs it")

        step("compile ResNet-18 (cached after the first run)")
        from dspx.compiler import examples
        from dspx.compiler.onnx import compile_onnx
        from dspx.host.verifier import DeviceVerifier
        CACHE.mkdir(parents=True, exist_ok=True)
        onnx_path = CACHE / "resnet18.onnx"
        if not onnx_path.exists():
            examples.resnet18(onnx_path)
        module = CACHE / "resnet18"
        if not (module / "model.so").exists():
            t = time.monotonic()
            with DeviceVerifier() as verifier:  # the module checked on a private device first
                compile_onnx(onnx_path, module, verifier=verifier)
            print(f"compiled in {time.monotonic() - t:.1f} s")
        else:
            print(f"using {module}")

        step("run ResNet-18 on the device")
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        with dspx.VirtualMachine(module, client=dev) as vm:
            y = vm["main"](x)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                vm["main"](x)
                times.append(time.perf_counter() - t)
            print(f"output {y.shape} {y.dtype}, top-5 classes {np.argsort(y[0])[::-1][:5].tolist()}")
            print(f"latency {np.median(times) * 1e3:.1f} ms (device cycles {vm.last_cycles:,}); "
                  f"staging at 0x{dev.staging.dsp_addr:X}")
        import onnxruntime as ort
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
        ref = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        print(f"max |device - onnxruntime| = {np.max(np.abs(y - ref)):.2e}")

        step("custom operator: softmax 0x1402, direct vs ping-pong (the UCP sample)")
    n = 100_000
    with Tasks() as ucp:
        data, param, out_d, out_t = softmax_data(ucp, n)
        softmax_param(param, data, n, tiled=False)
        d = ucp.run(SOFTMAX_CMD, param, out_d)
        softmax_param(param, data, n, tiled=True)
        t = ucp.run(SOFTMAX_CMD, param, out_t)
        same = np.max(np.abs(out_d.view(np.float32) - out_t.view(np.float32)) / out_d.view(np.float32)) <= 1e-6
        print(f"direct {d.cycles:,} cycles, ping-pong {t.cycles:,} cycles: {'same' if same else 'DIFFERENT'}")
    softmax_estimate(n)

    step("SmolLM2-135M on the device (compiled once, cached)")
    from dspx.host.llm import demo_generate
    demo_generate("What is the capital of France?", max_tokens=48)
    return 0


if __name__ == "__main__":
    sys.exit(main())
