"""Who is calling, and who a job runs as."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from stasis.errors import PermissionDeniedError, UsageError


@dataclass(frozen=True)
class Caller:
    """A client of the daemon, as the kernel reports it (SO_PEERCRED): never taken from a request."""

    pid: int
    uid: int
    gid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def may_act_on(self, uid: int) -> bool:
        return self.is_root or self.uid == uid

    def require(self, uid: int, what: str) -> None:
        if not self.may_act_on(uid):
            raise PermissionDeniedError(f"permission denied: {what} belongs to another user")

    def may_use_checkpoint(self, uid: int, user: str) -> bool:
        """A Kubernetes namespace's checkpoints (owner `k8s:NS`) are root's to handle: older
        stasis gave them owner uids a local account could have (2**30 and up)."""
        return self.may_act_on(uid) and (self.is_root or not user.startswith(K8S_OWNER_PREFIX))

    def require_checkpoint(self, uid: int, user: str, what: str) -> None:
        if not self.may_use_checkpoint(uid, user):
            raise PermissionDeniedError(f"permission denied: {what} belongs to another user")


# The owner name of a Kubernetes namespace's checkpoints: `k8s:<namespace>`.
K8S_OWNER_PREFIX = "k8s:"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: list[int]
    home: str
    shell: str


def account(user: str | int) -> Account:
    """Look up a user by name or numeric uid."""
    try:
        entry = pwd.getpwuid(int(user)) if str(user).isdigit() else pwd.getpwnam(str(user))
    except (KeyError, ValueError):
        raise UsageError(f"unknown user {user!r}") from None
    return Account(
        name=entry.pw_name,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        groups=os.getgrouplist(entry.pw_name, entry.pw_gid),
        home=entry.pw_dir,
        shell=entry.pw_shell,
    )


def owner_uid(caller: Caller, requested: str | None) -> int:
    """Whose checkpoints a label names: the caller's own, or (root only) those of the user named
    by name or uid. A uid need not exist on this node: its checkpoints may come from another."""
    if requested is None:
        return caller.uid
    numeric = requested.isascii() and requested.isdigit()
    uid = int(requested) if numeric else account(requested).uid
    if uid != caller.uid and not caller.is_root:
        raise PermissionDeniedError(
            f"permission denied: only root may use another user's checkpoints (--user {requested})"
        )
    return uid


def user_name(uid: int) -> str:
    """The name of `uid` on this node, or the number when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def job_account(caller: Caller, requested: str | None) -> Account:
    """The account a new job runs as: the caller's own, or (root only) any named user."""
    if requested is None:
        return account(caller.uid)
    wanted = account(requested)
    if not caller.is_root and wanted.uid != caller.uid:
        raise PermissionDeniedError(
            f"permission denied: only root may run jobs as another user ({wanted.name})"
        )
    return wanted


BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def job_environment(acct: Account, extra: dict[str, str]) -> dict[str, str]:
    """A clean login-like environment plus the caller's --env values (nothing else leaks in)."""
    env = {
        "PATH": BASE_PATH,
        "HOME": acct.home,
        "USER": acct.name,
        "LOGNAME": acct.name,
        "SHELL": acct.shell,
        "LANG": "C.UTF-8",
    }
    for key, value in extra.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise UsageError(f"bad environment variable {key!r}: use --env NAME=VALUE")
        env[key] = value
    return env
