"""Fleet: mint throughput through Ray on 1 and 2 nodes, plan time for 10,000+ keys against the remote,
and the shared store's transfer throughput against a real S3 server.

Each part is a module of its own: fleet_throughput.py (does a second Ray node add mints per
second), fleet_plan_remote.py (what a plan of 10,000+ keys costs against the shared store),
fleet_transfer.py (publish and fetch throughput beside boto3's), over fleet_servers.py (the S3
servers on loopback and what each command asked of them).

Writes benchmarks/results/fleet.json: `throughput` rewrites the file but keeps
`plan_against_remote`; `plan-remote` adds or replaces only `plan_against_remote`. Against
SeaweedFS, `plan-remote --store seaweedfs` and `transfer` write `plan_against_remote` and
`transfer` of benchmarks/results/fleet_seaweedfs.json.

    python benchmarks/fleet.py throughput [--keys 3] [--reps 3]
    python benchmarks/fleet.py plan-remote --python PY [--families 50] [--shapes 10] [--cpu-families 0]
        [--reps 7] [--clone-reps 3] [--code HEAD] [--store moto|seaweedfs]
    python benchmarks/fleet.py transfer [--sizes 100 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fleet_plan_remote import plan_remote
from fleet_servers import SERVERS
from fleet_throughput import throughput
from fleet_transfer import transfer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    tp = sub.add_parser("throughput", help="fleet mint throughput on 1 and 2 Ray nodes")
    tp.add_argument("--keys", type=int, default=3, help="distinct toy keys minted per run")
    tp.add_argument("--reps", type=int, default=3, help="rounds (each mints on 1 then 2 nodes)")
    pr = sub.add_parser("plan-remote", help="plan of 10,000+ keys against the shared S3 store")
    pr.add_argument(
        "--python", type=Path, required=True, help="a Python with a CUDA build of torch and cgbuild"
    )
    pr.add_argument("--families", type=int, default=50)
    pr.add_argument("--shapes", type=int, default=10, help="shapes per module")
    pr.add_argument("--cpu-families", type=int, default=0, help="families that also serve on the CPU")
    pr.add_argument("--reps", type=int, default=7, help="fresh processes per warm measurement")
    pr.add_argument("--clone-reps", type=int, default=3, help="clean-clone plans")
    pr.add_argument("--publish-threads", type=int, default=8)
    pr.add_argument("--code", default="HEAD", help="commit to measure (exported), or 'worktree'")
    pr.add_argument("--keep", action="store_true", help="keep the temporary folder")
    pr.add_argument("--store", choices=sorted(SERVERS), default="moto", help="the S3 server on loopback")
    tr = sub.add_parser("transfer", help="publish and fetch throughput against SeaweedFS")
    tr.add_argument("--sizes", type=int, nargs="+", default=[100, 1024], help="artifact sizes in MiB")
    tr.add_argument("--reps", type=int, default=3, help="rounds per size")
    tr.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    {"throughput": throughput, "plan-remote": plan_remote, "transfer": transfer}[args.part](args)


if __name__ == "__main__":
    main()
