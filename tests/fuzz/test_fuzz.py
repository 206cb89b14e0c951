"""Short structure-aware fuzz run (part of `make test`); the long run is
`python benchmarks/fuzz.py --messages 1000000` (docs/testing.md)."""
import struct
import time

from conftest import SMALL, Device
from tests.fuzz import Fuzzer, check_response, device_footprint

MESSAGES = 6000
KEEP = ("carveout_used", "ddr_used", "connections", "modules", "op_count")


def test_check_response_rules():
    req = struct.pack("<IIIi", 0x21, 9, 16, 0)
    assert check_response(req, struct.pack("<IIIi", 0x1021, 9, 16, -2)) is None
    assert "seq" in check_response(req, struct.pack("<IIIi", 0x1021, 8, 16, -2))
    assert "type" in check_response(req, struct.pack("<IIIi", 0x1022, 9, 16, -2))
    assert "len" in check_response(req, struct.pack("<IIIi", 0x1021, 9, 24, -2) + bytes(4))
    assert check_response(b"", struct.pack("<IIIi", 0x1000, 0, 16, -2)) is None


def test_fuzz_short_run_zero_crashes_hangs_or_leaks(compiled):
    from dspx.host.client import Client

    dev = Device(*SMALL)
    try:
        observer = Client(dev.path, staging_size=0, printf_size=0, timeout=20)
        other = Client(dev.path, staging_size=1 << 20, kv_size=1 << 16, timeout=20)
        other.alloc(4096)
        foreign = [(b.dsp_addr, b.size) for b in other.bufs]
        foreign.append((other.staging.dsp_addr + other.staging.size - other.kv_size, other.kv_size))
        before = observer.pools()
        fds_before = device_footprint(dev.proc.pid)["fds_front"]

        fz = Fuzzer(dev.path, {n: compiled(n) for n in ("multi_input", "multi_output")}, seed=7,
                    foreign=foreign, front_pid=dev.proc.pid, reset_every=2000, window=8,
                    fixture_every=500)
        stats = fz.run(MESSAGES)
        fz.close()
        report = stats.as_dict()
        assert stats.sent >= MESSAGES - 10
        assert (stats.malformed, stats.extra_responses, stats.hangs, stats.crashes) == (0, 0, 0, 0), report
        assert stats.core_restarts == 0, report
        # What the fuzzer's docstring promises: no internal failure, the status
        # each single mutation class must get, ERR_ADDR for every forged address.
        assert "ERR_GENERIC" not in report["by_status"], report["internal_errors"]
        assert stats.unexpected == 0, report["problems"]
        assert stats.forged_addresses > 100, report["by_expectation"]
        for cls in ("framing", "not a request type", "reserved field", "unknown flag bits", "forged address",
                    "forged descriptor address", "inline descriptor count", "descriptor table size",
                    "BUF_ATTACH fd count", "descriptor data_size/dtype"):
            assert report["by_expectation"].get(cls, 0) > 0, (cls, report["by_expectation"])
        assert dev.alive()
        # Deep paths were reached: jobs ran and both refusals and successes came back.
        assert report["by_status"].get("SUCCESS", 0) > 200 and report["by_status"].get("ERR_ADDR", 0) > 50
        assert report["by_status"].get("ERR_TENSOR", 0) > 10 and report["by_status"].get("ERR_LOAD", 0) > 5

        # The device still answers and holds nothing for the fuzz connection.
        assert observer.ping()["version"] == "3.0.0"
        deadline = time.monotonic() + 2
        while True:
            after = observer.pools()
            if all(after[k] == before[k] for k in KEEP) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert {k: after[k] for k in KEEP} == {k: before[k] for k in KEEP}
        assert device_footprint(dev.proc.pid)["fds_front"] == fds_before
        other.close()
        observer.close()
    finally:
        dev.stop()


def test_core_channel_fuzz_the_front_restarts_the_core_for_every_bad_record():
    """Fake cores write mutated records to a real front (tests/fuzz/core_channel.py)."""
    from tests.fuzz import core_channel

    res = core_channel.run(40, seed=3)
    assert (res["hangs"], res["front_died"], res["tracebacks"]) == (0, False, 0), res
    assert res["ping_after"] and res["sent"] == 40, res
    # every call got its one answer: an ERR_CALL (the core restarted, or its own
    # failure), or damaged bytes its own core delivered to it
    assert res["answered"] + res.get("garbage_to_own_client", 0) == 40, res
    assert res["invalid_records"] >= 20, res  # most mutations are invalid, and each one restarted a core
