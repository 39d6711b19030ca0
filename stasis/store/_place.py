"""Where a store's parts work (the URL users name and the tree behind it), and how they word
its failures: one readable line each, naming the store, the checkpoint and what to do."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from stasis.errors import CorruptCheckpointError, NotFoundError, StoreError
from stasis.store._tree import Tree

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Place:
    url: str
    tree: Tree

    def why(self, e: BaseException) -> str:
        """One line about `e`, in the backend's words where it has some (S3's refusals)."""
        said = self.tree.describe(e)
        return said if said is not None else reason(e)

    def not_found(self, checkpoint_id: str) -> NotFoundError:
        return NotFoundError(f"no checkpoint {checkpoint_id} in store {self.url}")

    def read_error(self, checkpoint_id: str, e: BaseException) -> StoreError:
        return StoreError(f"cannot read checkpoint {checkpoint_id} from {self.url}: {self.why(e)}")

    def write_error(self, checkpoint_id: str, e: BaseException) -> StoreError:
        if errno_in_chain(e) in NO_SPACE:
            return StoreError(
                f"no space left on {self.url} while writing checkpoint {checkpoint_id}: "
                "free space or point STASIS_STORE elsewhere"
            )
        return StoreError(f"cannot write checkpoint {checkpoint_id} to {self.url}: {self.why(e)}")

    def failed(self, what: str, e: BaseException) -> StoreError:
        """StoreError "cannot `what` in <store>: why" (listing, collecting garbage...)."""
        return StoreError(f"cannot {what} {self.url}: {self.why(e)}")


def corrupt(checkpoint_id: str, file: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {checkpoint_id} is corrupt: {file} {what}; "
        f"delete it with `stasis checkpoints rm {checkpoint_id}`"
    )


def errno_in_chain(e: BaseException) -> int | None:
    """The errno of `e` or of the OSError it wraps: codecs and fsspec re-raise write errors."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def reason(e: BaseException) -> str:
    """One line about `e`: the OS's words and the file, without the errno noise."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
