"""Write tests/slow_costs.json from a pytest run's ``--durations=0`` lines, read on stdin.

    .venv/bin/python -m pytest -q -m slow -n 2 --dist loadgroup --durations=0 | tee slow.txt
    .venv/bin/python tests/slow_costs.py < slow.txt

or, from the whole suite's run (``-n 3 --dist loadgroup --durations=0``), its lanes' lines
only: ``grep '@slow-' whole.txt | .venv/bin/python tests/slow_costs.py``.

Each slow test's ``call`` seconds (its set-up and teardown added), rounded to a tenth, by
its id without xdist's ``@<lane>`` suffix: what tests/conftest.py balances the lanes on.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)$")


def main() -> int:
    costs: dict[str, float] = defaultdict(float)
    for line in sys.stdin:
        m = LINE.match(line)
        if m:
            costs[m.group(3).rsplit("@", 1)[0]] += float(m.group(1))
    if not costs:
        print("no --durations lines on stdin (run pytest with --durations=0)", file=sys.stderr)
        return 2
    out = Path(__file__).with_name("slow_costs.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in sorted(costs.items())}, indent=1) + "\n")
    print(f"{out}: {len(costs)} tests, {sum(costs.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
