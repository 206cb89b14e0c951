"""Score of the last `mutmut run` (``make mutants``): killed / all mutants,
then every survivor, marked when tests/mutants-survivors.md justifies it.

    .venv/bin/python tests/mutants_score.py [--json]
"""
from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KILLED = {"killed", "timeout"}  # a mutant that hangs the tests is caught by the timeout
# Whole files are mutated; of runtime.py only the tile manager and DMA engine
# (and what they share) are in scope, of loader.py only the checks.  Mutants
# elsewhere in those two files are counted apart ("outside the scope").
IN_SCOPE = {
    "dspx.device.core.runtime.": ("xǁTileManagerǁ", "xǁDmaEngineǁ", "xǁ_Copyǁ", "xǁCoreRuntimeǁ", "x__count",
                                  "x__data_ptr"),
    "dspx.device.core.loader.": ("x__check_ident", "x__inspect", "x__symbol_bytes", "x_load_module",
                                 "x_parse_weights", "xǁMappedModuleǁprepare", "xǁMappedModuleǁcheck_weights",
                                 "xǁMappedModuleǁset_weights", "xǁElfInfoǁ"),
}


def in_scope(name: str) -> bool:
    for module, parts in IN_SCOPE.items():
        if name.startswith(module):
            return name[len(module):].startswith(parts)
    return True


def results() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True,
                         text=True, check=True).stdout  # run where `mutmut run` ran
    return {name.strip(): status.strip() for name, _, status in (ln.rpartition(":") for ln in out.splitlines())
            if name.strip()}


def justified() -> set[str]:
    """Mutant names (or fnmatch-free prefixes ending in ``*``) listed in the survivors file."""
    text = (HERE / "mutants-survivors.md").read_text() if (HERE / "mutants-survivors.md").exists() else ""
    return set(re.findall(r"`(dspx\.[^`]+)`", text))


def is_justified(name: str, just: set[str]) -> bool:
    return name in just or any(j.endswith("*") and name.startswith(j[:-1]) for j in just)


def main() -> None:
    everything = results()
    res = {n: s for n, s in everything.items() if in_scope(n)}
    outside = collections.Counter(s for n, s in everything.items() if not in_scope(n))
    counts = collections.Counter(res.values())
    killed = sum(counts[s] for s in KILLED)
    total = len(res) - counts["skipped"]
    survivors = sorted(n for n, s in res.items() if s not in KILLED | {"skipped"})
    just = justified()
    unjustified = [n for n in survivors if not is_justified(n, just)]
    score = killed / total if total else 0.0
    if "--json" in sys.argv:
        print(json.dumps({"mutants": total, "killed": killed, "score": round(score, 4), "by_status": counts,
                          "survivors": survivors, "unjustified": unjustified, "outside_scope": outside}))
        return
    for n in survivors:
        print(f"{'  justified ' if is_justified(n, just) else '  SURVIVED  '}{n}: {res[n]}")
    print(f"mutants {total}: killed {killed} ({score:.1%}); {len(survivors)} not killed, "
          f"{len(survivors) - len(unjustified)} of them justified in tests/mutants-survivors.md "
          f"({dict(counts)}); outside the scope (rest of runtime.py / loader.py): {dict(outside)}")


if __name__ == "__main__":
    main()
