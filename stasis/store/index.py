"""The label index: which checkpoints a (label, owner) has, newest first, without reading them all.

Finding a label's newest checkpoint by reading every manifest in the store costs one request per
checkpoint: fine for 20 on a disk, far too slow for 10,000 on S3. So every checkpoint also has an
empty index entry, `<root>/.index/<label>/<uid>/<entry>`, whose name sorts newest first as a plain
string (object stores list keys in that order, so the newest is on the first page):

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

from stasis.store.manifest import ID_PATTERN

INDEX_DIR = ".index"
FORMAT_FILE = "format"
FORMAT = b"1\n"
_SPAN_US = 10**17
_ENTRY_RE = re.compile(r"^([0-9]{17})-(" + ID_PATTERN.strip("^$") + r")$")


@dataclass(frozen=True, order=True)
class Entry:
    """One index entry; entries sort newest first (like their names)."""

    name: str
    uid: int
    checkpoint_id: str
    created: datetime


def entry_name(created: datetime, checkpoint_id: str) -> str:
    micros = round(created.timestamp() * 1_000_000)
    return f"{_SPAN_US - micros:017d}-{checkpoint_id}"


def parse_entry(name: str, uid: int) -> Entry | None:
    """The entry named `name` under uid `uid`'s directory; None for anything else."""
    found = _ENTRY_RE.fullmatch(name)
    if found is None:
        return None
    micros = _SPAN_US - int(found.group(1))
    created = datetime.fromtimestamp(micros / 1_000_000, UTC)
    return Entry(name=name, uid=uid, checkpoint_id=found.group(2), created=created)


def parse_uid(name: str) -> int | None:
    return int(name) if name.isdigit() and len(name) <= 10 else None
