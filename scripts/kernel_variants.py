"""Write sguard/kernel_variants.json (what `sguard kernels warm` compiles) from numba's disk
cache of this checkout's kernels: every variant the cache holds for the current source, added
to those the file already lists (``--replace``: only the cache's).

Run it after the test suite and the benchmarks have run on the source tree
(``SGUARD_TEST_SOURCE=1 bash scripts/test.sh``, ``.venv/bin/python -m bench.<name> --quick``),
so that the cache holds the argument types they use:

    .venv/bin/python scripts/kernel_variants.py            # writes sguard/kernel_variants.json
    .venv/bin/python scripts/kernel_variants.py --check    # exit 1 if a listed variant is not cached
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def import_all() -> None:
    """Import every module of the packages that define kernels, so that all are defined."""
    for top in ("mmm", "ioservice", "sguard"):
        pkg = importlib.import_module(top)
        for m in pkgutil.walk_packages(pkg.__path__, f"{top}."):
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "sguard" / "kernel_variants.json"))
    ap.add_argument("--replace", action="store_true",
                    help="write only what the cache holds (default: add it to the file's list)")
    ap.add_argument("--check", action="store_true",
                    help="compare with --out instead of writing it")
    args = ap.parse_args()
    import_all()
    from mmm import cached_kernel_variants
    found = {k: sorted(v) for k, v in sorted(cached_kernel_variants().items())}
    if args.check:
        from sguard.kernels import read_variants
        listed = read_variants(args.out)
        missing = [(k, v) for k, vs in listed.items() for v in vs if v not in found.get(k, [])]
        for k, v in missing:
            print(f"not cached: {k} {v}")
        return 1 if missing else 0
    if not args.replace and Path(args.out).exists():
        from sguard.kernels import read_variants
        for k, vs in read_variants(args.out).items():
            found[k] = sorted(set(found.get(k, [])) | set(vs))
        found = dict(sorted(found.items()))
    doc = {"format": 1, "kernels": found}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"{sum(map(len, found.values()))} variants of {len(found)} kernels -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
