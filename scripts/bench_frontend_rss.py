"""Resident memory of the engine-serve API process (the frontend alone, not its engine core), once healthy and
after a few requests: the figure quoted in the README's layout section.

    python scripts/bench_frontend_rss.py                 # the embedded model
"""
from __future__ import annotations

import argparse

import psutil

from pagedserve.tests.helpers.server import Server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=8)
    args = p.parse_args()
    srv = Server(model=args.model)
    try:
        api = psutil.Process(srv.proc.pid)
        idle = api.memory_info().rss
        client = srv.client()
        for _ in range(args.requests):
            client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=8)
        served = api.memory_info().rss
        mib = 1 << 20
        print(f"API process RSS: {idle / mib:.0f} MiB healthy, {served / mib:.0f} MiB after {args.requests} requests")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
