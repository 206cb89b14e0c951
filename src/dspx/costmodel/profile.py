"""Machine profiles: the timing model's parameters, as data.

A profile is a JSON file (the format is in COST-SPEC / docs/cost-model.md):
``{"name", "title", "kind": "vector-dsp", "params": {NAME: {"value", "unit",
"status", "source", "range"?}}}``.  Every parameter says where its value
comes from: ``status`` is ``public`` (a published figure), ``assumed`` (first
principles; then ``range`` gives the plausible [low, high]) or
``calibrated`` (measured on a board).  dspx ships ``j6-vision`` and
``c7x-j722s``; a user may pass a file of their own.  A file that breaks a
rule is refused with one ProfileError naming the file, the key and what was
expected.

``DSPX_COST_MODEL`` (``ENV``) switches the model on for a device: a profile
name, a path to a profile file, or a profile's JSON text itself (what the
front hands its cores: ``resolve_env``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Mapping

ENV = "DSPX_COST_MODEL"
STATUSES = ("public", "assumed", "calibrated")
KINDS = ("vector-dsp",)

# Parameters every vector-dsp profile has (what the counting clock reads),
# and whether each must be a whole number.
REQUIRED = {
    "clock_hz": False, "vector_bits": True,
    "issue_load_store": False, "issue_alu": False, "issue_mul": False, "issue_special": False,
    "issue_move": False,
    "ddr_cached": True, "ddr_load_latency_cycles": True, "ddr_store_cycles": True,
    "ddr_bandwidth_bytes_per_cycle": False, "tcm_load_latency_cycles": True,
    "idma_channels": True, "idma_setup_cycles": True, "idma_bandwidth_bytes_per_cycle": False,
    "tcm_banks": True, "call_overhead_cycles": True,
}
# Rates and sizes the model divides by: they must be above zero.
POSITIVE = ("clock_hz", "vector_bits", "issue_load_store", "issue_alu", "issue_mul", "issue_special",
            "issue_move", "ddr_bandwidth_bytes_per_cycle", "idma_channels", "idma_bandwidth_bytes_per_cycle",
            "tcm_banks")
_PARAM_KEYS = {"value", "unit", "status", "source", "range"}


class ProfileError(ValueError):
    """A profile that cannot be used: the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Param:
    name: str
    value: int | float
    unit: str
    status: str
    source: str
    range: tuple[int | float, int | float] | None = None

    def as_dict(self) -> dict:
        d = {"value": self.value, "unit": self.unit, "status": self.status, "source": self.source}
        if self.range is not None:
            d["range"] = list(self.range)
        return d


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    title: str
    kind: str
    params: Mapping[str, Param]
    origin: str  # "builtin" or the file it was read from

    def param(self, name: str) -> int | float:
        """The value of one parameter; ProfileError if the profile has none."""
        p = self.params.get(name)
        if p is None:
            raise ProfileError(f"{self.origin}: profile {self.name!r} has no parameter {name!r}")
        return p.value

    def values(self) -> dict[str, int | float]:
        """Every parameter's value by name (what a counting clock or the C shim is configured with)."""
        return {n: p.value for n, p in self.params.items()}

    def assumed(self) -> dict[str, int | float]:
        """The assumed parameters' values: what every estimate prints beside itself."""
        return {n: p.value for n, p in self.params.items() if p.status == "assumed"}

    def describe(self) -> dict:
        """The whole profile as plain data (``dspx info --cost-model NAME``, ``--json``)."""
        return {"name": self.name, "title": self.title, "kind": self.kind, "origin": self.origin,
                "params": {n: p.as_dict() for n, p in self.params.items()}}

    def to_json(self) -> str:
        """The profile in its file format, on one line (DSPX_COST_MODEL can carry it)."""
        return json.dumps({"name": self.name, "title": self.title, "kind": self.kind,
                           "params": {n: p.as_dict() for n, p in self.params.items()}},
                          separators=(",", ":"))


def names() -> list[str]:
    """The profiles shipped with dspx."""
    return sorted(f.name.removesuffix(".json") for f in _profiles_dir().iterdir() if f.name.endswith(".json"))


def load(name_or_path: str) -> Profile:
    """A shipped profile by name, a profile file by path, or a profile's JSON text."""
    text = str(name_or_path).strip()
    if text.startswith("{"):
        return parse(text, f"${ENV}")
    if text in names():
        return parse(_profiles_dir().joinpath(f"{text}.json").read_text(encoding="utf-8"), "builtin",
                     expect_name=text)
    if os.sep in text or text.endswith(".json") or os.path.exists(text):
        try:
            with open(text, encoding="utf-8") as f:
                data = f.read()
        except OSError as e:
            raise ProfileError(f"{text}: cannot read the profile file ({e.strerror or e})") from None
        return parse(data, text)
    raise ProfileError(f"cost model {text!r}: no such profile (shipped: {', '.join(names())}) and no such file")


def from_env(environ: Mapping[str, str] | None = None) -> Profile | None:
    """The profile ``DSPX_COST_MODEL`` names, or None when it is unset or empty (the model is off)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    return load(value) if value else None


def resolve_env(environ=None) -> Profile | None:
    """For a device's front, before it starts cores: check the profile
    ``DSPX_COST_MODEL`` names (a bad one fails the start, not a core) and,
    when it is a user's file, replace the path by the profile's JSON text,
    so every core (and every restarted core) gets the same parameters
    without opening a file of the user's under its sandbox."""
    env = os.environ if environ is None else environ
    profile = from_env(env)
    if profile is not None and profile.origin != "builtin":
        env[ENV] = profile.to_json()
    return profile


# ------------------------------------------------------------------ parsing

def _profiles_dir():
    return resources.files(__package__).joinpath("profiles")


def parse(text: str, origin: str, expect_name: str | None = None) -> Profile:
    """A Profile from a profile file's text; ``origin`` names it in errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{origin}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: expected a JSON object at the top, got {type(data).__name__}")
    name = _text(data, "name", origin)
    if expect_name is not None and name != expect_name:
        raise ProfileError(f"{origin}: name: expected {expect_name!r} (the file's name), got {name!r}")
    title = _text(data, "title", origin)
    kind = _text(data, "kind", origin)
    if kind not in KINDS:
        raise ProfileError(f"{origin}: kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    unknown = set(data) - {"name", "title", "kind", "params"}
    if unknown:
        raise ProfileError(f"{origin}: unknown top-level key {sorted(unknown)[0]!r} "
                           f"(expected name, title, kind, params)")
    raw = data.get("params")
    if not isinstance(raw, dict):
        raise ProfileError(f"{origin}: params: expected an object of parameters, got {type(raw).__name__}")
    params = {n: _param(n, p, origin) for n, p in raw.items()}
    for n, whole in REQUIRED.items():
        if n not in params:
            raise ProfileError(f"{origin}: params.{n}: missing (a {kind} profile needs "
                               f"{', '.join(REQUIRED)})")
        v = params[n].value
        if whole and v != int(v):
            raise ProfileError(f"{origin}: params.{n}.value: expected a whole number, got {v!r}")
        if whole:
            params[n] = Param(n, int(v), params[n].unit, params[n].status, params[n].source, params[n].range)
    for n in POSITIVE:
        if params[n].value <= 0:
            raise ProfileError(f"{origin}: params.{n}.value: expected a number above 0, got {params[n].value!r}")
    if params["ddr_cached"].value not in (0, 1):
        raise ProfileError(f"{origin}: params.ddr_cached.value: expected 0 or 1, got {params['ddr_cached'].value!r}")
    if params["vector_bits"].value % 32:
        raise ProfileError(f"{origin}: params.vector_bits.value: expected a multiple of 32, "
                           f"got {params['vector_bits'].value!r}")
    for n in ("ddr_load_latency_cycles", "ddr_store_cycles", "tcm_load_latency_cycles", "idma_setup_cycles",
              "call_overhead_cycles"):
        if params[n].value < 0:
            raise ProfileError(f"{origin}: params.{n}.value: expected 0 or more, got {params[n].value!r}")
    return Profile(name, title, kind, MappingProxyType(params), origin)


def _text(data: dict, key: str, origin: str) -> str:
    v = data.get(key)
    if not isinstance(v, str) or not v.strip():
        raise ProfileError(f"{origin}: {key}: expected a non-empty string, got {v!r}")
    return v


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _param(name: str, p, origin: str) -> Param:
    where = f"{origin}: params.{name}"
    if not isinstance(p, dict):
        raise ProfileError(f"{where}: expected an object with value, unit, status, source, got {type(p).__name__}")
    unknown = set(p) - _PARAM_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown key {sorted(unknown)[0]!r} (expected value, unit, status, source, range)")
    value = p.get("value")
    if not _number(value):
        raise ProfileError(f"{where}.value: expected a finite number, got {value!r}")
    for key in ("unit", "source"):
        if not isinstance(p.get(key), str) or not p[key].strip():
            raise ProfileError(f"{where}.{key}: expected a non-empty string, got {p.get(key)!r}")
    status = p.get("status")
    if status not in STATUSES:
        raise ProfileError(f"{where}.status: expected one of {', '.join(STATUSES)}, got {status!r}")
    rng = p.get("range")
    if rng is None:
        if status == "assumed":
            raise ProfileError(f"{where}.range: missing; an assumed parameter needs its plausible [low, high]")
    else:
        if not (isinstance(rng, list) and len(rng) == 2 and all(_number(x) for x in rng)):
            raise ProfileError(f"{where}.range: expected [low, high] (two numbers), got {rng!r}")
        if not rng[0] <= value <= rng[1]:
            raise ProfileError(f"{where}.range: expected low <= value <= high, got {rng!r} for value {value!r}")
        rng = (rng[0], rng[1])
    return Param(name, value, p["unit"], status, p["source"], rng)
