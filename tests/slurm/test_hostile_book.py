"""A job's step book as its user may write it: the node daemon (root) reads it from outside the
job's IPC namespace, and nothing in it may crash or hang that reader (issue 27, item 3).

The attacker is the job's user in their own IPC namespace (here: `unshare --ipc`, then the
unprivileged test user); the reader is the daemon's own BookReader. The end-to-end version,
through Slurm and the daemon: tests/e2e/test_hostile_step_book.py."""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stasis.slurm import steps
from stasis.slurm.mirrors import BookReader
from tests.conftest import ROOT, WORKLOADS

HEADER = 16
BOOK = 1 << 18


@pytest.fixture
def reader() -> Iterator[BookReader]:
    r = BookReader()
    yield r
    r.close()


# Takes commands on stdin, in an IPC namespace of its own: "<size> <hex bytes>" replaces the
# book's segment with one of <size> bytes starting with those bytes; "chown <uid>" gives it
# away (IPC_SET); each answered "ok <shmid>" (or "err <why>").
PLANTER = textwrap.dedent("""
    import ctypes, os, sys
    KEY = 0x53544550
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    libc.shmdt.argtypes = (ctypes.c_void_p,)
    libc.shmctl.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    print("ready", flush=True)
    shm = -1
    for line in sys.stdin:
        words = line.split()
        if words[0] == "chown":
            buf = ctypes.create_string_buffer(512)
            libc.shmctl(shm, 2, buf)  # IPC_STAT
            ctypes.c_uint32.from_buffer(buf, 4).value = int(words[1])
            ok = libc.shmctl(shm, 1, buf) == 0  # IPC_SET
            print(f"ok {shm}" if ok else f"err {os.strerror(ctypes.get_errno())}", flush=True)
            continue
        if shm >= 0:
            libc.shmctl(shm, 0, None)  # IPC_RMID
        size, data = int(words[0]), bytes.fromhex(words[1] if len(words) > 1 else "")
        shm = libc.shmget(KEY, size, 0o1000 | 0o2000 | 0o600)
        if shm < 0:
            print(f"err {os.strerror(ctypes.get_errno())}", flush=True)
            continue
        address = libc.shmat(shm, None, 0)
        ctypes.memmove(address, data, min(len(data), size))
        libc.shmdt(address)
        print(f"ok {shm}", flush=True)
""")


class Planter:
    """A process of the test user in an IPC namespace of its own, planting segments there."""

    def __init__(self, user: str) -> None:
        self.proc = subprocess.Popen(
            ["unshare", "--ipc", "runuser", "-u", user, "--", sys.executable, "-c", PLANTER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        self.ns = os.open(f"/proc/{self.proc.pid}/ns/ipc", os.O_RDONLY)
        # The planter is runuser's child: its namespace is the one unshare made.
        self.uid = pwd.getpwnam(user).pw_uid

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def plant(self, size: int, data: bytes) -> None:
        answer = self.ask(f"{size} {data.hex()}")
        assert answer.startswith("ok"), answer

    def close(self) -> None:
        os.close(self.ns)
        self.proc.communicate("", timeout=30)


@pytest.fixture
def planter(test_user: pwd.struct_passwd) -> Iterator[Planter]:
    p = Planter(test_user.pw_name)
    yield p
    p.close()


def header(used: int, magic: int = 0x5354_5331) -> bytes:
    return struct.pack("=4I", magic, 1, used, 0)


def test_a_one_page_segment_claiming_256_KiB_is_refused_and_the_reader_lives(
    planter: Planter,
) -> None:
    """The daemon's reader, in a process of its own so that a crash shows as one: it reads the
    job's namespace through /proc/<planter>/ns/ipc, as the daemon does."""
    page = os.sysconf("SC_PAGE_SIZE")
    planter.plant(page, header(BOOK - HEADER) + b'{"step": 0, "where": "stasis"}\n')
    code = textwrap.dedent(f"""
        import os
        from stasis.slurm import steps
        from stasis.slurm.mirrors import BookReader
        r = BookReader()
        fd = os.open("/proc/{planter.proc.pid}/ns/ipc", os.O_RDONLY)
        try:
            print("records", r.read(fd, {planter.uid}))
        except steps.BookRefused as e:
            print("refused", e)
        print("alive", flush=True)
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, f"the reader died ({result.returncode}): {result.stderr}"
    assert (
        f"refused its header claims {BOOK - HEADER} bytes of records, the segment holds "
        f"{page - HEADER}" in result.stdout
    )
    assert result.stdout.endswith("alive\n")


def test_a_segment_of_another_owner_is_refused(planter: Planter, reader: BookReader) -> None:
    good = header(31) + b'{"step": 0, "where": "stasis"}\n'
    planter.plant(BOOK, good)
    assert reader.read(planter.ns, planter.uid) == [{"step": 0, "where": "stasis"}]
    with pytest.raises(
        steps.BookRefused,
        match=rf"owned by uid {planter.uid} and was created "
        rf"by uid {planter.uid}, not by the job's user \(uid 0\)",
    ):
        reader.read(planter.ns, 0)
    # Given away (IPC_SET): its owner is no longer the job's user.
    assert planter.ask("chown 0").startswith("ok")
    with pytest.raises(steps.BookRefused, match="owned by uid 0 and was created by uid"):
        reader.read(planter.ns, planter.uid)


def test_a_book_criu_restored_for_the_user_is_read(
    reader: BookReader, test_user: pwd.struct_passwd
) -> None:
    """CRIU (root) creates a restored job's segments and gives them their owner back: created
    by root, owned by the job's user, the book is the job's."""
    restorer = Planter("root")
    try:
        restorer.plant(BOOK, header(31) + b'{"step": 0, "where": "stasis"}\n')
        with pytest.raises(steps.BookRefused, match="owned by uid 0"):
            reader.read(restorer.ns, test_user.pw_uid)
        assert restorer.ask(f"chown {test_user.pw_uid}").startswith("ok")
        assert reader.read(restorer.ns, test_user.pw_uid) == [{"step": 0, "where": "stasis"}]
    finally:
        restorer.close()


def test_ipc_stat_is_read_with_the_kernels_layout(planter: Planter) -> None:
    """What segment_stat finds (through our struct shmid_ds) is what /proc/sysvipc/shm says."""
    planter.plant(12345, b"")
    out = subprocess.run(
        ["nsenter", f"--ipc=/proc/{planter.proc.pid}/ns/ipc", "cat", "/proc/sysvipc/shm"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names, *rows = [line.split() for line in out.splitlines()]
    row = dict(zip(names, rows[0]))
    code = textwrap.dedent(f"""
        import ctypes, json, os
        from stasis.slurm import steps
        libc = steps._shm_libc()
        fd = os.open("/proc/{planter.proc.pid}/ns/ipc", os.O_RDONLY)
        assert libc.setns(fd, 0x08000000) == 0
        st = steps.segment_stat(libc, libc.shmget(0x53544550, 0, 0))
        print(json.dumps([st.uid, st.cuid, st.size_bytes]))
    """)
    found = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    )
    assert (
        found
        == [int(row["uid"]), int(row["cuid"]), int(row["size"])]
        == [planter.uid, planter.uid, 12345]
    )


# -- fuzz: every byte a job's user may put there -------------------------------------------------


def _record() -> st.SearchStrategy[bytes]:
    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=10,
    )
    fields = st.fixed_dictionaries(
        {},
        optional={
            "step": json_values | st.integers(-2, 70),
            "where": st.sampled_from(["stasis", "slurm"]) | json_values,
            "exit": json_values,
            "signal": json_values,
            "name": json_values,
            "ntasks": json_values,
            "argv": json_values,
        },
    )
    lines = (
        fields.map(lambda d: json.dumps(d).encode())
        | st.binary(max_size=64)
        | st.sampled_from(
            [
                b"[" * 100_000,
                b'{"step": 1e999}',
                b'{"step": ' + b"9" * 5000 + b"}",
                b'{"step": 0, "name": "\xff\xfe"}',
                b"\x00" * 50,
            ]
        )
    )
    return st.lists(lines, max_size=12).map(b"\n".join)


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    data=st.binary(max_size=600) | _record().map(lambda r: header(len(r)) + r),
    used=st.none() | st.integers(0, 2**32 - 1),
)
def test_fuzz_parse_book_and_fold(data: bytes, used: int | None) -> None:
    """Any bytes: a list of records (each a dict with a step id in range), or BookRefused."""
    if used is not None and len(data) >= HEADER:
        data = data[:8] + struct.pack("=I", used) + data[12:]
    try:
        records = steps.fold(steps.parse_book(data))
    except steps.BookRefused:
        return
    for rec in records:
        assert isinstance(rec, dict)
        n = rec["step"]
        assert type(n) is int and 0 <= n < 1 << 31


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(body=_record())
def test_fuzz_each_record_is_what_steprecord_says(body: bytes) -> None:
    """Whatever the job's user writes, what the daemon gets back holds the types and bounds
    StepRecord declares (the mirrors use the values as they come)."""
    declared = steps.StepRecord.__required_keys__ | steps.StepRecord.__optional_keys__
    for rec in steps.fold(body):
        assert set(rec) <= declared
        assert type(rec["step"]) is int and 0 <= rec["step"] < 1 << 31
        assert rec.get("where", "stasis") in ("stasis", "slurm")
        assert all(type(a) is str for a in rec.get("argv", []))
        assert type(rec.get("name", "")) is str and type(rec.get("reason", "")) is str
        assert type(rec.get("ntasks", 1)) is int and rec.get("ntasks", 1) >= 1
        if "exit" in rec:
            assert type(rec["exit"]) is int and 0 <= rec["exit"] <= 255
            assert type(rec["signal"]) is int and 0 <= rec["signal"] <= 64
        else:
            assert "signal" not in rec


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    size=st.sampled_from(
        [1, 15, 16, 17, 4095, 4096, 4097, 65536, BOOK - 1, BOOK, BOOK + 1, 3 * BOOK]
    )
    | st.integers(1, 3 * BOOK),
    used=st.integers(0, 2**32 - 1) | st.integers(0, BOOK),
    body=_record(),
)
def test_fuzz_real_segments_through_the_daemons_reader(
    planter: Planter, reader: BookReader, size: int, used: int, body: bytes
) -> None:
    """Real segments of any size, any header, any records, read by the daemon's BookReader
    (in this process: a fault would end the test run)."""
    planter.plant(size, header(used) + body)
    try:
        records = reader.read(planter.ns, planter.uid)
    except steps.BookRefused:
        assert used > min(size, BOOK) - HEADER or size < HEADER
        return
    assert used <= min(size, BOOK) - HEADER
    assert all(type(r["step"]) is int for r in records)


def test_a_workload_that_plants_the_book_plants_what_the_e2e_test_needs(
    planter: Planter, reader: BookReader, test_user: pwd.struct_passwd
) -> None:
    """tests/workloads/hostile_book.py (the e2e test's job) plants a one-page segment claiming
    256 KiB: the reader refuses it."""
    proc = subprocess.Popen(
        [
            "unshare",
            "--ipc",
            "runuser",
            "-u",
            test_user.pw_name,
            "--",
            "python3",
            "-u",
            str(WORKLOADS / "hostile_book.py"),
            "0.05",
            "3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("planted ")
    fd = os.open(f"/proc/{proc.pid}/ns/ipc", os.O_RDONLY)
    try:
        with pytest.raises(steps.BookRefused, match="claims 262128 bytes of records"):
            reader.read(fd, test_user.pw_uid)
    finally:
        os.close(fd)
        proc.communicate(timeout=30)


def test_the_kernel_copy_stops_at_an_unmapped_page() -> None:
    """_copy_out reads through the kernel: a range that runs off a mapping comes back short
    (or empty), never as a fault in this process."""
    libc = steps._shm_libc()
    page = os.sysconf("SC_PAGE_SIZE")
    mm = ctypes.CDLL(None, use_errno=True)
    mm.mmap.restype = ctypes.c_void_p
    mm.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    mm.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    # Two pages, the second made inaccessible: the copy may read the first only.
    address = mm.mmap(None, 2 * page, 3, 0x22, -1, 0)  # PROT_READ|WRITE, PRIVATE|ANONYMOUS
    mm.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    try:
        ctypes.memset(address, 0x41, page)
        assert mm.mprotect(address + page, page, 0) == 0
        assert steps._copy_out(libc, address, page) == b"A" * page
        assert steps._copy_out(libc, address, 2 * page) == b"A" * page
        assert steps._copy_out(libc, address + page, page) == b""
    finally:
        mm.munmap(address, 2 * page)
