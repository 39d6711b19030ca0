"""Named dump/restore option sets. A fast path lands in stasis -> add one entry here, by name.

A mode is what the user passes to `stasis dump` / `stasis restore`, plus what the plain CRIU
baseline needs to be comparable (leave-running). `needs` lists (subcommand, token) pairs that the
subcommand's --help must show; a mode whose options stasis does not have yet is skipped with that
reason instead of failing the suite.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    help: str
    dump_args: tuple[str, ...] = ()
    restore_args: tuple[str, ...] = ()
    # The restore returns before all memory is back: time that separately (digest round trip).
    lazy: bool = False
    needs: tuple[tuple[str, str], ...] = ()

    @property
    def leave_running(self) -> bool:
        return "--leave-running" in self.dump_args


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("default", "stop-and-dump, no compression (stasis' defaults)"),
        Mode(
            "leave-running",
            "dump while the job keeps running afterwards",
            dump_args=("--leave-running",),
        ),
        Mode("zstd", "dump compressed with zstd", dump_args=("--compress", "zstd")),
        Mode("lz4", "dump compressed with lz4", dump_args=("--compress", "lz4")),
        # The fast paths of issue 4; skipped against a stasis that does not have them.
        Mode(
            "auto",
            "compression chosen by sampling pages",
            dump_args=("--compress", "auto"),
            needs=(("dump", "auto"),),
        ),
        # Encryption at rest: the same dump and restore with the images sealed (AES-256-GCM) under
        # the bench daemon's own key file; held against "default" (no more than 10% slower).
        Mode(
            "encrypt",
            "stop-and-dump with the images encrypted",
            dump_args=("--encrypt",),
            needs=(("dump", "--encrypt"),),
        ),
        # An encrypted checkpoint restored lazily: its pages decrypted as lazy-pages fetches them
        # (stasis/daemon/lazystore.py); "memory back" is what to hold against encrypt's restore.
        Mode(
            "encrypt-lazy",
            "encrypted dump, lazy restore served from the store",
            dump_args=("--encrypt",),
            restore_args=("--lazy",),
            lazy=True,
            needs=(("dump", "--encrypt"), ("restore", "--lazy")),
        ),
        # The plain CRIU baseline stays a full `criu restore`: what a user has without stasis.
        Mode(
            "lazy",
            "lazy restore (userfaultfd), memory paged in after the job runs",
            restore_args=("--lazy",),
            lazy=True,
            needs=(("restore", "--lazy"),),
        ),
    )
}

DEFAULT_MODES = ("default", "leave-running", "encrypt")


def parse_modes(text: str) -> list[Mode]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    return [MODES[n] for n in names]
