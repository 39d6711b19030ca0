"""The one exception tree of stasis.

    StasisError
    ├── UsageError            bad input from a caller (unknown id, invalid path)  -> CLI exit 2
    │   └── NotFoundError     an unknown job or checkpoint id / label
    ├── PermissionDeniedError a caller acting on something that is not theirs
    ├── CRIUError             CRIU failed; carries the log path and the first real error line
    │   └── CRIUNotFoundError no usable CRIU binary
    ├── CheckpointError       a dump could not be taken or published
    ├── RestoreError          a restore failed
    │   ├── OwnerDeniedError  a path of the job is one its owner may not open now
    │   └── IncompatibleNodeError  this node differs from the dumping one in a way the restore
    │                              cannot cope with (refused before CRIU runs)
    ├── StoreError            the checkpoint store failed (I/O, full disk)
    │   ├── CorruptCheckpointError  a checkpoint failed verification
    │   │   └── UnreadableManifestError  its manifest is garbage: nobody can tell whose it is
    │   ├── UntrustedCheckpointError its manifest is unsigned, tampered, or signed by a key this
    │   │                            node does not trust
    │   └── EncryptionKeyError  an encrypted checkpoint whose key this node does not have
    ├── ContainerError        runc or containerd failed on a container
    │   └── ContainerRootDamagedError  a container's writable layer was put back in part only
    ├── KubernetesError       the Kubernetes API could not be reached or refused a call
    ├── SlurmError            Slurm's tools failed, are missing, or did not answer
    │   └── SlurmJobNotFoundError   Slurm knows no such job (also a NotFoundError)
    ├── ControlPlaneError     the control plane's database or API failed
    │   └── ControlPlaneUnreachableError  nothing (or no HTTP) answers at its URL
    └── DaemonAPIError        the daemon answered with an error, or could not be reached

Beside UsageError and PermissionDeniedError, for the APIs' callers: `ConflictError` (a
UsageError, 409: at odds with what the server holds) and `UnauthenticatedError` (a
PermissionDeniedError, 401: a token unknown, revoked or expired).

Outside the tree, `ReaderGone`: a pipe's reader (CRIU reading streamed images) closed it before
the end. Not a failure of ours, so nothing translates it: whoever fed the pipe decides.

Foreign errors are translated at the edge (`raise StoreError(...) from e`); code that must decide
what to do next branches on the class, never on message text. The CLI prints `str(error)` as one
line and exits with `error.exit_code`.
"""

from __future__ import annotations


class StasisError(Exception):
    """Base of every error stasis raises on purpose."""

    exit_code: int = 1
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(StasisError):
    exit_code = 2
    http_status = 400


class NotFoundError(UsageError):
    http_status = 404


class PermissionDeniedError(StasisError):
    exit_code = 2
    http_status = 403


class UnauthenticatedError(PermissionDeniedError):
    """No token, or one unknown, revoked or expired (a node's credential reset by an admin)."""

    http_status = 401


class ConflictError(UsageError):
    """At odds with what the server holds: a node joined already, a lease no longer held, a
    command already answered, a job id that several nodes report."""

    http_status = 409


class CRIUError(StasisError):
    """CRIU reported a failure. `log_path` points at the full CRIU log, when one was written."""

    def __init__(self, message: str, log_path: str | None = None) -> None:
        if log_path:
            message = f"{message} (CRIU log: {log_path})"
        super().__init__(message)
        self.log_path = log_path


class CRIUNotFoundError(CRIUError):
    pass


class CheckpointError(StasisError):
    pass


class RestoreError(StasisError):
    pass


class OwnerDeniedError(RestoreError):
    http_status = 403


class IncompatibleNodeError(RestoreError):
    http_status = 409


class StoreError(StasisError):
    pass


class CorruptCheckpointError(StoreError):
    http_status = 422


class UnreadableManifestError(CorruptCheckpointError):
    pass


class UntrustedCheckpointError(StoreError):
    http_status = 422


class EncryptionKeyError(StoreError):
    http_status = 422


class ContainerError(StasisError):
    http_status = 502


class ContainerRootDamagedError(ContainerError):
    """A checkpoint's writable layer was put back in part only: the new container's root
    holds some of it, so neither an older checkpoint nor a fresh start would run on a root
    any image or checkpoint had. The container's create fails; its next one gets a new root."""


class KubernetesError(StasisError):
    """The Kubernetes API could not be reached or refused a call (stasis.k8s.kube)."""

    http_status = 502  # a service the daemon relies on failed, not the daemon itself


class SlurmError(StasisError):
    http_status = 502  # a tool the daemon relies on failed, not the daemon itself


class SlurmJobNotFoundError(SlurmError, NotFoundError):
    exit_code = NotFoundError.exit_code
    http_status = NotFoundError.http_status


class ControlPlaneError(StasisError):
    """The control plane's database or API failed."""


class ControlPlaneUnreachableError(ControlPlaneError):
    """Nothing (or no HTTP) answers at the control plane's URL."""


class DaemonAPIError(StasisError):
    """The daemon could not be reached, or answered with an error of the given HTTP status."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status
        if status in (400, 404, 403):
            self.exit_code = 2


_BY_NAME: dict[str, type[StasisError]] = {
    cls.__name__: cls
    for cls in (
        StasisError,
        UsageError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
        ConflictError,
        CRIUError,
        CRIUNotFoundError,
        CheckpointError,
        RestoreError,
        OwnerDeniedError,
        StoreError,
        CorruptCheckpointError,
        IncompatibleNodeError,
        UnreadableManifestError,
        UntrustedCheckpointError,
        EncryptionKeyError,
        SlurmError,
        SlurmJobNotFoundError,
        ContainerError,
        ContainerRootDamagedError,
        KubernetesError,
        ControlPlaneError,
        ControlPlaneUnreachableError,
    )
}


def wire_name(e: StasisError) -> str:
    """The name an error travels under: its own class's, or the nearest one the other side
    can rebuild (a module's private subclass goes as the public error it refines)."""
    return next(
        c.__name__ for c in type(e).__mro__ if c.__name__ in _BY_NAME and _BY_NAME[c.__name__] is c
    )


def error_from_wire(kind: str, message: str) -> StasisError:
    """Rebuild an error the daemon sent as {"error": {"type": kind, "message": message}}."""
    return _BY_NAME.get(kind, StasisError)(message)


class ReaderGone(Exception):
    """The reader of a pipe we were writing closed its end (see the module docstring)."""
