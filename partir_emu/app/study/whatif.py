"""What-if edits of a hardware spec without writing a TOML file: ``ici_bw*2``, ``hbm_gb=64``,
``chip.flops_bf16_per_s*1.5``, several joined by ``,`` (``ici_bw*2,hbm_bw*1.5``).

A field is named by an alias (:data:`ALIASES`, the questions users ask: "a 2x faster interconnect",
"64 GB of HBM") or as ``table.field`` of the spec file, or as a field name found in exactly one
table. ``FIELD*X`` scales the spec's own value, ``FIELD=V`` sets it (``hbm_gb``/``hbm_gib`` take
10^9/2^30 bytes). The edited spec is marked ``what_if`` (the sensible-range checks of real hardware
are off: a study may go beyond it) and named after its edits, ``tpu-v4[ici_bw*2]``. Every mistake (an
unknown field, an alias the chip has no such field for, a non-number) is a
:class:`~partir_emu.errors.UsageError` naming the edit and the fields it could mean.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partir_emu.errors import SpecError, UsageError
from partir_emu.hwmodels.machine.specs import HardwareSpec, find_spec, load_spec
from partir_emu.limits import load_toml

# alias -> {spec kind: fields it edits}; a value given in the alias's unit is multiplied by UNITS
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "flops": {"tpu": ("chip.flops_bf16_per_s", "chip.flops_f32_per_s"),
              "gpu": ("chip.flops_bf16_per_s", "chip.flops_f32_per_s")},
    "hbm_bw": {"tpu": ("chip.hbm_bw_bytes_per_s",), "gpu": ("chip.hbm_bw_bytes_per_s",)},
    "hbm_gb": {"tpu": ("chip.hbm_bytes",), "gpu": ("chip.hbm_bytes",)},
    "hbm_gib": {"tpu": ("chip.hbm_bytes",), "gpu": ("chip.hbm_bytes",)},
    "ici_bw": {"tpu": ("ici.link_bw_bytes_per_s",), "gpu": ("nvlink.nvlink_bw_bytes_per_s",)},
    "ici_latency": {"tpu": ("ici.link_latency_s",), "gpu": ("nvlink.nvlink_latency_s",)},
    "nvlink_bw": {"gpu": ("nvlink.nvlink_bw_bytes_per_s",)},
    "nic_bw": {"gpu": ("network.nic_bw_bytes_per_s",), "tpu": ("dcn.host_bw_bytes_per_s",)},
    "ib_latency": {"gpu": ("network.ib_latency_s",)},
    "dcn_bw": {"tpu": ("dcn.host_bw_bytes_per_s",)},
}
UNITS = {"hbm_gb": 1e9, "hbm_gib": 2.0 ** 30}
INT_FIELDS = ("hbm_bytes", "links_per_chip", "gpus_per_node", "nics_per_node", "chips_per_host")
_EDIT = re.compile(r"\s*([A-Za-z_][\w.]*)\s*([*=])\s*([-+0-9.eE]+)\s*")


@dataclass(frozen=True)
class Edit:
    field: str          # as written: an alias, table.field or a bare field
    op: str             # "*" or "="
    value: float

    def __str__(self) -> str:
        short = f"{self.value:g}"
        return f"{self.field}{self.op}{short if float(short) == self.value else repr(self.value)}"


@dataclass(frozen=True)
class WhatIf:
    """One what-if: edits applied together (``ici_bw*2,hbm_gb=64``); the empty one is the spec as it is."""

    edits: tuple[Edit, ...] = ()

    @property
    def label(self) -> str:
        return ",".join(map(str, self.edits)) or "as is"

    @staticmethod
    def parse(text: str) -> WhatIf:
        edits = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = _EDIT.fullmatch(part)
            if m is None:
                raise UsageError(f"--what-if {part!r}: write FIELD*FACTOR or FIELD=VALUE, e.g. ici_bw*2 or "
                                 f"hbm_gb=64 (fields: {', '.join(ALIASES)} or table.field of the spec)")
            try:
                value = float(m.group(3))
            except ValueError:
                raise UsageError(f"--what-if {part!r}: {m.group(3)!r} is not a number") from None
            if not value > 0:
                raise UsageError(f"--what-if {part!r}: the value must be > 0")
            edits.append(Edit(m.group(1), m.group(2), value))
        if not edits:
            raise UsageError(f"--what-if {text!r}: no edit; write e.g. ici_bw*2")
        return WhatIf(tuple(edits))

    def overrides(self, raw: Mapping[str, Any], kind: str, spec_name: str) -> dict[str, Any]:
        """The ``load_spec`` overrides of these edits on the parsed spec file ``raw``."""
        out: dict[str, Any] = {}
        for e in self.edits:
            before = dict(out)
            for key in _fields(e.field, raw, kind, spec_name):
                table, _, fld = key.rpartition(".")
                old = before.get(key, raw.get(table, {}).get(fld) if table else raw.get(fld))  # edits compose
                if not isinstance(old, (int, float)) or isinstance(old, bool):
                    raise UsageError(f"--what-if {e}: {spec_name} has no number at {key} to edit")
                v = old * e.value if e.op == "*" else e.value * UNITS.get(e.field, 1.0)
                if e.op == "=" and e.field == "flops" and key.endswith("f32_per_s"):
                    # f32 keeps its ratio to bf16
                    v = old * e.value / before.get("chip.flops_bf16_per_s", raw["chip"]["flops_bf16_per_s"])
                out[key] = int(round(v)) if fld in INT_FIELDS else float(v)
        return out


def _fields(name: str, raw: Mapping[str, Any], kind: str, spec_name: str) -> tuple[str, ...]:
    if name in ALIASES:
        keys = ALIASES[name].get(kind)
        if not keys:
            raise UsageError(f"--what-if {name}: a {kind} spec ({spec_name}) has no such field; aliases for it: "
                             f"{', '.join(a for a, k in ALIASES.items() if kind in k)}")
        return keys
    if "." in name:
        return (name,)
    found = [f"{t}.{name}" for t, sub in raw.items() if isinstance(sub, dict) and name in sub]
    if len(found) != 1:
        raise UsageError(f"--what-if {name}: {'no field' if not found else 'several fields'} of {spec_name} "
                         f"{'is' if not found else 'are'} named so{': ' + ', '.join(found) if found else ''}; "
                         f"write table.field or one of {', '.join(a for a, k in ALIASES.items() if kind in k)}")
    return (found[0],)


def apply(hardware: str, what_if: WhatIf) -> HardwareSpec:
    """The spec ``hardware`` (a name or path) with ``what_if``'s edits."""
    if not what_if.edits:
        return load_spec(hardware)
    raw = load_toml(find_spec(hardware), SpecError, "hardware spec")
    over = what_if.overrides(raw, str(raw.get("kind")), str(raw.get("name", hardware)))
    # the edited chip keeps the measured kernel rates of the chip it edits (they are looked up by name)
    over.update({"what_if": True, "name": f"{raw.get('name', hardware)}[{what_if.label}]",
                 "kernels_measured_as": str(raw.get("kernels_measured_as") or raw.get("name", hardware))})
    return load_spec(hardware, over)


__all__ = ["ALIASES", "Edit", "WhatIf", "apply"]
