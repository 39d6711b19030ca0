"""The label index: which checkpoints a (label, owner) has, newest first, without reading them all.

Finding a label's newest checkpoint by reading every manifest in the store costs one request per
checkpoint: fine for 20 on a disk, far too slow for 10,000 on S3. So every checkpoint also has an
empty index entry, `<root>/.index/<label>/<uid>/<entry>`, whose name sorts newest first as a plain
string (object stores list keys in that order, so the newest is on the first page):

    0<MAX_SEQ - seq, 11 digits>-<10**17 - created, in microseconds, 17 digits>-<checkpoint id>

that is by sequence number first (manifest.order_key: a child above its parent, a later publish
above what it saw), the dumping node's clock only between two published at once. Checkpoints
published before sequence numbers have entries without one, which sort after every numbered
one (a created date before 2286 makes their first digit a 9), among themselves by clock:

    <10**17 - created, in microseconds since the epoch, 17 digits>-<checkpoint id>

The entry is written BEFORE the manifest and removed after it. So every published checkpoint has
one, and an entry whose checkpoint has no manifest is a publish under way, or one that died (`gc`
removes those once they are old). Readers trust an entry only as far as the signed manifest it
leads to: its label and owner must match, else the entry is ignored.

The index is complete once `<root>/.index/format` exists: `Store.ensure_index` writes it after
adding an entry for every checkpoint already in the store (a store written by a stasis without
an index). Until then readers scan every manifest, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from stasis.store.manifest import ID_PATTERN, MAX_SEQ

INDEX_DIR = ".index"
FORMAT_FILE = "format"
FORMAT = b"1\n"
_SPAN_US = 10**17
_ENTRY_RE = re.compile(r"^(?:0([0-9]{11})-)?([0-9]{17})-(" + ID_PATTERN.strip("^$") + r")$")


@dataclass(frozen=True, order=True)
class Entry:
    """One index entry; entries sort newest first (like their names)."""

    name: str
    uid: int
    checkpoint_id: str
    created: datetime
    seq: int | None = None


def entry_name(created: datetime, checkpoint_id: str, seq: int | None = None) -> str:
    micros = round(created.timestamp() * 1_000_000)
    name = f"{_SPAN_US - micros:017d}-{checkpoint_id}"
    return name if seq is None else f"0{MAX_SEQ - seq:011d}-{name}"


def parse_entry(name: str, uid: int) -> Entry | None:
    """The entry named `name` under uid `uid`'s directory; None for anything else."""
    found = _ENTRY_RE.fullmatch(name)
    if found is None:
        return None
    micros = _SPAN_US - int(found.group(2))
    created = datetime.fromtimestamp(micros / 1_000_000, UTC)
    seq = MAX_SEQ - int(found.group(1)) if found.group(1) is not None else None
    if seq is not None and seq < 1:
        return None
    return Entry(name=name, uid=uid, checkpoint_id=found.group(3), created=created, seq=seq)


def parse_uid(name: str) -> int | None:
    return int(name) if name.isdigit() and len(name) <= 10 else None
