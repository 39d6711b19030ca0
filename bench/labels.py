"""`python -m bench.labels`: restore-by-label lookups in stores of 100, 1,000 and 10,000 checkpoints.

What a restore by label and `checkpoints --label` cost in store time (`Store.latest`,
`Store.list(label, uid)`), on a local directory and on S3 (a SeaweedFS server started here), with
the label index, against the baseline measured in the same run: reading every manifest (what the
store did before the index, and still does for a store whose index is incomplete).

The checkpoints are real, signed manifests with their index entries, written in bulk (their
image files are not needed to find them): N checkpoints over N/10 labels of one owner; each
lookup asks for a label holding 10 checkpoints. Results: bench/results/<stamp>-labels.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from stasis.store import CheckpointInfo, FileEntry, Manifest, Store, new_checkpoint_id
from stasis.store.index import INDEX_DIR, entry_name
from stasis.store.store import MANIFEST_PURPOSE
from tests.s3server import REGION, S3Server

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (100, 1000, 10000)
PER_LABEL = 10
TARGETS_S = {"local": 0.050, "s3": 0.300}  # the targets for a lookup


def _manifests(store: Store, n: int) -> list[Manifest]:
    base = datetime(2026, 12, 1, tzinfo=UTC)
    made = []
    for i in range(n):
        created = base + timedelta(seconds=i)
        info = CheckpointInfo(
            id=new_checkpoint_id(created),
            label=f"label-{i % (n // PER_LABEL)}",
            job="0123456789ab",
            host="bench",
            created=created,
            criu_version="4.2",
            command=["python3", "train.py"],
            cwd="/",
            user="bench",
            uid=1000,
            gid=1000,
        )
        entry = FileEntry(
            name="pages-1.img",
            size_bytes=4096,
            stored_name="pages-1.img",
            stored_size_bytes=4096,
            xxh3_128="0" * 32,
        )
        manifest = Manifest.build(info, "none", [entry])
        body = json.loads(manifest.model_dump_json(exclude={"signature"}))
        made.append(
            manifest.model_copy(update={"signature": store.keys.sign(MANIFEST_PURPOSE, body)})
        )
    return made


def _fill_local(root: Path, store: Store, n: int) -> None:
    for m in _manifests(store, n):
        (root / m.id).mkdir(parents=True)
        (root / m.id / "manifest.json").write_text(m.model_dump_json())
        owner = root / INDEX_DIR / m.label / str(m.uid)
        owner.mkdir(parents=True, exist_ok=True)
        (owner / entry_name(m.created, m.id)).touch()
    store.ensure_index()


def _fill_s3(fs: Any, prefix: str, store: Store, n: int) -> None:
    objects: dict[str, bytes] = {}
    for m in _manifests(store, n):
        objects[f"{prefix}/{m.id}/manifest.json"] = m.model_dump_json().encode()
        objects[f"{prefix}/{INDEX_DIR}/{m.label}/{m.uid}/{entry_name(m.created, m.id)}"] = b""
    items = list(objects.items())
    for start in range(0, len(items), 2000):
        fs.pipe(dict(items[start : start + 2000]))
    store.ensure_index()


def _median(fn: Callable[[], object], runs: int) -> tuple[float, float, float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), min(times), max(times)


def _measure(where: str, store: Store, scan: Store, n: int, runs: int) -> list[dict[str, Any]]:
    label = f"label-{(n // PER_LABEL) // 2}"
    expected = store.latest(label, uid=1000).id
    assert scan.latest(label, uid=1000).id == expected
    rows = []
    for what, fn in (
        ("latest", lambda: store.latest(label, uid=1000)),
        ("list --label", lambda: store.list(label, uid=1000)),
    ):
        med, lo, hi = _median(fn, runs)
        rows.append(
            {
                "store": where,
                "checkpoints": n,
                "lookup": what,
                "method": "index",
                "median_s": med,
                "min_s": lo,
                "max_s": hi,
            }
        )
    # Reading every manifest: what the index replaces. Once at 10,000 on S3 (tens of seconds).
    scan_runs = 1 if n >= 10000 else max(1, runs // 4)
    med, lo, hi = _median(lambda: scan.latest(label, uid=1000), scan_runs)
    rows.append(
        {
            "store": where,
            "checkpoints": n,
            "lookup": "latest",
            "method": "every manifest",
            "median_s": med,
            "min_s": lo,
            "max_s": hi,
        }
    )
    return rows


def run(sizes: tuple[int, ...], runs: int, out: Path) -> Path:
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="stasis-bench-labels-"))
    for n in sizes:
        root = work / f"local-{n}"
        store = Store(str(root), staging_root=work / "staging", keep=0)
        _fill_local(root, store, n)
        rows += _measure("local", store, _scan_store(str(root), store, {}), n, runs)
        print(f"local {n}: {rows[-3]['median_s'] * 1000:.1f} ms", file=sys.stderr)
    with S3Server(work / "s3") as s3:
        fs = s3.filesystem()
        options = {
            "key": s3.access_key,
            "secret": s3.secret_key,
            "client_kwargs": {"endpoint_url": s3.endpoint, "region_name": REGION},
        }
        for n in sizes:
            bucket = s3.make_bucket(f"labels-{n}")
            url = f"s3://{bucket}/ckpt"
            store = Store(url, staging_root=work / "staging", keep=0, options=options)
            _fill_s3(fs, f"{bucket}/ckpt", store, n)
            rows += _measure("s3", store, _scan_store(url, store, options), n, runs)
            print(f"s3 {n}: {rows[-3]['median_s'] * 1000:.1f} ms", file=sys.stderr)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stamp}-labels.json").write_text(
        json.dumps({"rows": rows, "targets_s": TARGETS_S}, indent=2)
    )
    md = out / f"{stamp}-labels.md"
    md.write_text(_report(rows))
    return md


def _scan_store(url: str, store: Store, options: dict[str, Any]) -> Store:
    scan = Store(url, staging_root=Path(tempfile.mkdtemp()), keys=store.keys, options=options)
    scan._tree.index_ready = lambda: False  # type: ignore[method-assign]
    return scan


def _report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Restore by label: store time per lookup (median of runs, min-max)",
        "",
        "| store | checkpoints | lookup | method | median ms | min-max ms | target |",
        "|---|---:|---|---|---:|---|---|",
    ]
    for r in rows:
        target = ""
        if r["method"] == "index" and r["lookup"] == "latest":
            limit = TARGETS_S[r["store"]]
            target = f"< {limit * 1000:.0f} ms: {'met' if r['median_s'] < limit else 'MISSED'}"
        lines.append(
            f"| {r['store']} | {r['checkpoints']:,} | {r['lookup']} | {r['method']} | "
            f"{r['median_s'] * 1000:.1f} | {r['min_s'] * 1000:.1f}-"
            f"{r['max_s'] * 1000:.1f} | {target} |"
        )
    by = {
        (r["store"], r["checkpoints"], r["method"]): r["median_s"]
        for r in rows
        if r["lookup"] == "latest"
    }
    lines += ["", "Index against reading every manifest (latest), same run:", ""]
    for (where, n, method), med in by.items():
        if method == "index":
            scan = by[(where, n, "every manifest")]
            lines.append(
                f"- {where}, {n:,}: {scan / med:.0f}x faster ({med * 1000:.1f} ms "
                f"vs {scan * 1000:.0f} ms)"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.labels", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    md = run(tuple(int(s) for s in args.sizes.split(",")), args.runs, args.out)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
