"""The fields of a hardware spec file: each value's type, and the sensible range of rates and latencies
(:func:`~partir_emu.hwmodels.machine.specs.spec_from_dict` checks every table with these)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from partir_emu.errors import SpecError

# sensible ranges of the rates and latencies (field-name ending -> (low, high, unit)): far outside any
# real chip or link, a value is a typo (a denormal bandwidth printed "inf ms"); a spec with
# what_if = true skips them. Memory sizes are not bounded: a tiny HBM is a useful what-if and
# prices finitely.
RANGES = {"flops_bf16_per_s": (1e9, 1e18, "FLOP/s"), "flops_f32_per_s": (1e9, 1e18, "FLOP/s"),
          "flops_fp8_per_s": (1e9, 1e18, "FLOP/s"), "spine_oversubscription": (1.0, 64.0, "(downlink : uplink)"),
          "vector_flops_per_s": (1e9, 1e18, "FLOP/s"),
          "bw_bytes_per_s": (1e6, 1e15, "B/s"), "latency_s": (1e-10, 1.0, "s"), "links_per_chip": (1, 64, ""),
          "gpus_per_node": (1, 1024, ""), "chips_per_host": (1, 1024, ""), "max_slices": (1, 1 << 16, ""), "nics_per_node": (1, 1024, ""), "nodes_per_leaf": (1, 1 << 20, ""),
          "nodes_per_su": (1, 1 << 20, ""), "max_nodes": (1, 1 << 20, ""),
          "pod_dims": (1, 4096, "chips per torus dim"), "cube": (1, 4096, "chips per cube dim"),
          "achieved_fraction": (1e-3, 1.0, "(a share of the nominal figure)")}


def check_ranges(vals: Mapping[str, Mapping[str, Any]], where: str) -> None:
    for table, fields in vals.items():
        for key, value in fields.items():
            rng = next((r for end, r in RANGES.items() if key.endswith(end)), None)
            for v in value if isinstance(value, tuple) else (value,):      # a list: each entry
                if rng is not None and isinstance(v, (int, float)) and not rng[0] <= v <= rng[1]:
                    raise SpecError(f"{where}: field {table}.{key} = {v if isinstance(v, int) else f'{v:g}'} is outside the sensible range "
                                    f"[{rng[0]:g}, {rng[1]:g}] {rng[2]}; fix it, or put what_if = true at the top "
                                    f"of the spec for a study beyond real hardware")


def top_source(data: Mapping[str, Any], key: str, where: str) -> str:
    """The ``<key>_source`` of a top-level field; a what-if spec (``what_if = true``) may leave it out."""
    src = str(data.get(f"{key}_source", "")).strip()
    if not src and not data.get("what_if", False):
        raise SpecError(f"{where}: field {key}_source is missing; say where {key} = {data.get(key)!r} comes from")
    return src or "a what-if of that chip"


def check_table(sub: Mapping[str, Any], fields: Mapping[str, tuple[Any, bool]], where: str, prefix: str,
                 allow_tables: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in sub.items():
        if key.endswith("_source"):
            if not isinstance(value, str):
                raise SpecError(f"{where}: field {prefix}{key} must be a string naming a public source")
            continue
        if allow_tables and isinstance(value, dict):
            continue
        if key not in fields:
            raise SpecError(f"{where}: unknown field {prefix}{key}; "
                            f"known fields here: {', '.join(prefix + f for f in fields)}")
        out[key] = check_value(value, fields[key][0], where, prefix + key)
    for key, (_, required) in fields.items():
        if required and key not in out:
            raise SpecError(f"{where}: field {prefix}{key} is missing; add it"
                            + (f" under [{prefix[:-1]}]" if prefix else " at the top level"))
    return out


def check_value(value: Any, typ: Any, where: str, name: str) -> Any:
    def bad(expected: str) -> SpecError:
        return SpecError(f"{where}: field {name} must be {expected}, got {type(value).__name__} {value!r}")

    if isinstance(typ, tuple):
        if value not in typ:
            raise bad("one of " + ", ".join(repr(t) for t in typ))
        return value
    if typ == "str":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise bad("a positive number")
        return float(value)
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad("a positive integer")
        return value
    if typ == "ints":
        if (not isinstance(value, list) or not value
                or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value)):
            raise bad("a non-empty list of positive integers")
        return tuple(value)
    raise AssertionError(typ)
