"""Where the test suite's time goes: seconds per test module, summed from a pytest junit report.

    .venv/bin/python scripts/suite_times.py [.pytest_cache/junit.xml] [--top N]

Every `pytest` run writes the report (pyproject.toml's addopts); the modules of 40 s or more belong in
tests/helpers/xdist_order.py's HEAVY table, which starts them first."""
from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def module_seconds(path: str) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split("::")[0]
        # junit's classname is the dotted module path (and class): back to the file's path
        parts = [p for p in module.split(".") if p and not p[0].isupper()]
        totals["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default=".pytest_cache/junit.xml")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    totals = module_seconds(args.report)
    for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{seconds:8.1f}  {module}")
    print(f"{sum(totals.values()):8.1f}  in all ({len(totals)} modules)")


if __name__ == "__main__":
    main()
