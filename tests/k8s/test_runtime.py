"""How stasis-runc reads the command lines containerd's shim gives runc."""

from __future__ import annotations

from stasis.k8s.runtime import Argv


def test_create_as_the_shim_calls_it() -> None:
    a = Argv(["--root", "/run/containerd/runc/k8s.io", "--log", "/b/log.json", "--log-format",
              "json", "create", "--bundle", "/b", "--pid-file", "/b/init.pid", "c1"])
    assert (a.command, a.root, a.globals["--log-format"]) == ("create", "/run/containerd/runc/"
                                                              "k8s.io", "json")
    assert a.option("--bundle", "-b") == "/b" and a.option("--pid-file") == "/b/init.pid"
    assert a.positionals() == ["c1"]


def test_kill_and_delete_and_the_default_root() -> None:
    a = Argv(["--root=/r", "kill", "--all", "c1", "15"])
    assert (a.command, a.root, a.positionals(), a.flag("--all")) == ("kill", "/r", ["c1", "15"],
                                                                      True)
    d = Argv(["delete", "--force", "c2"])
    assert (d.command, d.root, d.positionals()) == ("delete", "/run/runc", ["c2"])
