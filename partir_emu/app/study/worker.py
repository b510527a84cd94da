"""A study worker (``python -m partir_emu.app.study.worker``, started by :mod:`.pool`): reads its
options and then one group of configurations per line from stdin as JSON, prices each in one
:class:`~partir_emu.app.study.evaluate.Study` (so its caches serve every group it gets), and
writes one ``{"row": ...}`` line per configuration and ``{"done": true}`` per group on stdout
(with the worker's lowering and pricing seconds so far).
A :class:`~partir_emu.errors.PartirError` that escapes pricing is sent as ``{"error": ...}``."""
from __future__ import annotations

import json
import sys

from partir_emu.app.study.evaluate import Study
from partir_emu.app.study.space import Config
from partir_emu.errors import PartirError


def main() -> int:
    out = sys.stdout
    study: Study | None = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if "options" in msg:
                o = msg["options"]
                study = Study(o["stack"], o["placement"], o["overlap"])
                continue
            assert study is not None, "options come first"
            for d in msg["configs"]:
                out.write(json.dumps({"row": study.price(Config.from_json(d)).to_json()}) + "\n")
                out.flush()
        except PartirError as exc:
            out.write(json.dumps({"error": str(exc)}) + "\n")
            out.flush()
            return 1
        assert study is not None
        out.write(json.dumps({"done": True, "lower_s": study.lower_s, "price_s": study.price_s}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
