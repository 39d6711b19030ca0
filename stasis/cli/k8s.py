"""`stasis k8s ...` and `stasis dump --container ID`: the Kubernetes
integration's commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from stasis.cli import output
from stasis.cli.args import add_json, subcommands
from stasis.client import Client
from stasis.config import Settings

TAINT = "stasis.dev/not-ready:NoSchedule"  # stasis.k8s.kube's default, without importing it


def dump_container(client: Client, container_id: str, leave_running: bool, as_json: bool) -> None:
    """`stasis dump --container ID`: a checkpoint of a container under stasis on this node;
    it is stopped (killed once the checkpoint is published) unless --leave-running."""
    from stasis.k8s.runc import validate_container_id

    validate_container_id(container_id)
    with client:
        answer = client.k8s_checkpoint(container_id, reason="manual" if leave_running else "stop")
    if as_json:
        output.emit_json(answer)
        return
    then = (
        "stopped; it resumes from it when created again" if answer["stopped"] else "still running"
    )
    output.say(
        f"checkpoint {answer['checkpoint']} of container {container_id} "
        f"(label {answer['label']}, namespace {answer['namespace']}, "
        f"{answer['size_bytes']} bytes, {answer['duration_s']:.2f} s); container {then}"
    )


def add_k8s(commands: Any) -> None:
    top = commands.add_parser(
        "k8s", help="Kubernetes integration: the stasis runtime, the node agent, drain."
    )
    sub = subcommands(top)
    p = sub.add_parser(
        "install-runtime",
        help="Put the stasis runtime on this node (as the node "
        "agent does); then restart containerd.",
    )
    _node_options(p)
    p.add_argument(
        "--stasis-config",
        type=Path,
        default=Path("/etc/stasis/config.toml"),
        help="The daemon's config the runtime reads (default: %(default)s).",
    )
    p.add_argument("--dry-run", action="store_true", help="Print the changes; change nothing.")
    p.set_defaults(handler=install_runtime)
    p = sub.add_parser(
        "uninstall-runtime",
        help="Take the stasis runtime off this node again " "(containerd's config byte for byte).",
    )
    _node_options(p)
    p.set_defaults(handler=uninstall_runtime)
    p = sub.add_parser(
        "agent",
        help="The node agent (the chart's DaemonSet): runtime on the "
        "host, the daemon, the not-ready taint, cordon, by-hand "
        "and interval checkpoints of pods.",
    )
    p.add_argument(
        "--node",
        default="",
        help="This node's name in the API (default: " "STASIS_NODE_NAME, else the host name).",
    )
    _kubeconfig_option(p)
    p.add_argument(
        "--host-root",
        type=Path,
        default=None,
        help="Where the host's root is mounted: install the runtime there "
        "(default: install nothing).",
    )
    _node_options(p)
    p.add_argument(
        "--bundle-dir",
        type=Path,
        default=Path("/usr/local/lib/stasis"),
        help="Host directory of stasis-runc and CRIU (default: %(default)s).",
    )
    p.add_argument(
        "--runtime-config",
        type=Path,
        default=Path("/etc/stasis/runtime.toml"),
        help="Host file the runtime reads (default: %(default)s).",
    )
    p.add_argument(
        "--taint",
        default=f"{TAINT}",
        help="KEY:EFFECT kept on the node while stasis is not ready there "
        "(default: %(default)s).",
    )
    p.add_argument(
        "--restart-containerd",
        default="",
        help="Command that restarts the host's containerd once the runtime entry "
        "was added, e.g. 'nsenter -t 1 -m -- systemctl restart containerd'.",
    )
    p.add_argument(
        "--no-daemon",
        action="store_true",
        help="Use the daemon already running on STASIS_SOCKET; start none.",
    )
    p.set_defaults(handler=agent)
    p = sub.add_parser(
        "uninstall-nodes",
        help="The chart's pre-delete hook: ask the agent of "
        "every node to take stasis off it (runtime "
        "entry, shim, bundle, taint) and wait for them.",
    )
    p.add_argument("--namespace", required=True, help="The release's namespace.")
    p.add_argument(
        "--selector",
        required=True,
        help="The labels of the release's agent pods, as KEY=VALUE,KEY=VALUE.",
    )
    _kubeconfig_option(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="Seconds to wait for the agents' answers (default: %(default)s).",
    )
    p.set_defaults(handler=uninstall_nodes)
    p = sub.add_parser(
        "checkpoint",
        help="A leave-running checkpoint of a pod's containers, "
        "taken by the agent of the pod's node.",
    )
    p.add_argument("pod", metavar="NAMESPACE/POD")
    _kubeconfig_option(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="Seconds to wait for the agent's answer (default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=checkpoint_pod)
    p = sub.add_parser(
        "drain",
        help="This node: cordon it, checkpoint its containers under "
        "stasis as at their stop, evict their pods (they start "
        "again elsewhere, restored).",
    )
    p.add_argument(
        "--reason",
        default="stasis drain",
        help="Why: recorded as the reason of the containers' checkpoints "
        "(default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=drain)


def _node_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--containerd-config",
        type=Path,
        default=Path("/etc/containerd/config.toml"),
        help="containerd's config file, where the runtime entry goes (default: " "%(default)s).",
    )
    p.add_argument(
        "--bin-dir",
        type=Path,
        default=Path("/usr/local/bin"),
        help="A directory on containerd's PATH (default: %(default)s).",
    )
    p.add_argument(
        "--containerd-config-version",
        type=int,
        choices=(0, 2, 3),
        default=0,
        help="containerd's config version: 2 (containerd 1.x), 3 (2.x), 0: the "
        "file's own, 2 for a new file (default: %(default)s).",
    )


def _kubeconfig_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="The kubeconfig file of the Kubernetes API to use (default: "
        "STASIS_KUBECONFIG, else the pod's service account, else $KUBECONFIG "
        "or ~/.kube/config).",
    )


def agent(args: argparse.Namespace, settings: Settings) -> None:
    import logging
    import shlex
    import signal

    from stasis.errors import UsageError
    from stasis.k8s import kube
    from stasis.k8s.agent import Agent, HostInstall

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s stasis-agent %(levelname)s %(message)s"
    )
    install = None
    if args.host_root is not None:
        install = HostInstall(
            root=args.host_root,
            containerd_config=args.containerd_config,
            bin_dir=args.bin_dir,
            bundle=args.bundle_dir,
            runtime_config=args.runtime_config,
            restart_containerd=tuple(shlex.split(args.restart_containerd)),
            containerd_config_version=args.containerd_config_version,
        )
    key, _, effect = args.taint.partition(":")
    if not key or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise UsageError(
            f"--taint {args.taint!r} is not KEY:NoSchedule|PreferNoSchedule|" "NoExecute"
        )
    api = kube.connect(args.kubeconfig if args.kubeconfig is not None else settings.kubeconfig)
    node = Agent(
        settings=settings,
        api=api,
        node=args.node or settings.node,
        install=install,
        start_daemon=not args.no_daemon,
        taint=(key, effect),
    )
    signal.signal(signal.SIGTERM, lambda *_: node.stop.set())
    signal.signal(signal.SIGINT, lambda *_: node.stop.set())
    node.run()


def uninstall_nodes(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.k8s import kube
    from stasis.k8s.uninstall import uninstall_nodes as ask

    api = kube.connect(args.kubeconfig if args.kubeconfig is not None else settings.kubeconfig)
    answers = ask(api, args.namespace, args.selector, args.timeout)
    for node, answer in sorted(answers.items()):
        done = (
            "gone"
            if answer.get("gone")
            else "; ".join(answer.get("removed") or []) or "nothing was left"
        )
        output.say(f"node {node}: stasis taken off ({done})")
    if not answers:
        output.say("no node runs a stasis agent of this release: nothing to take off")


def checkpoint_pod(args: argparse.Namespace, settings: Settings) -> None:
    import time

    from stasis.errors import ContainerError, NotFoundError, UsageError
    from stasis.k8s import kube

    namespace, _, name = args.pod.partition("/")
    if not namespace or not name or "/" in name:
        raise UsageError(f"{args.pod!r} is not NAMESPACE/POD")
    api = kube.connect(args.kubeconfig if args.kubeconfig is not None else settings.kubeconfig)
    what = f"pod {namespace}/{name}"
    try:
        pod = kube.call(f"read {what}", api.read_namespaced_pod, name, namespace)
    except kube.KubeError as e:
        if " 404 " in str(e):
            raise NotFoundError(f"no {what}") from None
        raise
    node = getattr(pod.spec, "node_name", None)
    if not node:
        raise ContainerError(f"{what} is not on a node yet: nothing to checkpoint")
    token = kube.now_token()
    kube.annotate(api, "pod", pod, {kube.CHECKPOINT_ANNOTATION: token})
    deadline = time.monotonic() + args.timeout
    # The agent answers with an event on the pod (it may not write to pods).
    while (result := kube.answer_of(api, namespace, name, token)) is None:
        if time.monotonic() > deadline:
            raise ContainerError(
                f"the stasis agent of node {node} did not answer within "
                f"{args.timeout:.0f} s: is it running there (kubectl -n "
                "stasis-system get pods -o wide)?"
            )
        time.sleep(0.5)
    if args.json:
        output.emit_json(result)
    failed = [c for c, r in result.get("containers", {}).items() if "error" in r]
    if not args.json:
        for c, r in sorted(result.get("containers", {}).items()):
            if "error" in r:
                output.warn(f"container {c}: {r['error']}")
            else:
                output.say(f"container {c}: checkpoint {r['checkpoint']} (label {r['label']})")
    if result.get("error"):
        raise ContainerError(result["error"])
    if failed:
        raise ContainerError(f"{len(failed)} container(s) of {what} were not checkpointed")


def drain(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.errors import ContainerError

    with Client(settings.socket, timeout_s=None) as c:
        done = c.k8s_drain(reason=args.reason)
    if args.json:
        output.emit_json(done)
    else:
        output.say(f"node {done['k8s_node']} cordoned")
        for r in done["requeued"]:
            output.say(
                f"container {r['job']}: checkpoint {r['checkpoint']} (label "
                f"{r['label']}), pod {r['pod']} evicted"
            )
        for f in done["failed"]:
            output.warn(f)
    if done["failed"]:
        raise ContainerError(
            f"{len(done['failed'])} container(s) or pod(s) of node "
            f"{done['k8s_node']} were not moved off it"
        )


def install_runtime(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.k8s import shim

    for change in shim.install_node(
        args.containerd_config,
        args.bin_dir,
        args.stasis_config.absolute(),
        dry_run=args.dry_run,
        config_version=args.containerd_config_version,
    ):
        output.say(("would " if args.dry_run else "") + change)
    if not args.dry_run:
        output.say("restart containerd to load it (systemctl restart containerd)")


def uninstall_runtime(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.k8s import shim

    for change in shim.uninstall_node(args.containerd_config, args.bin_dir):
        output.say(change)


def add_export(commands: Any) -> None:
    p = commands.add_parser(
        "export",
        help="Write CHECKPOINT as an OCI image archive (the "
        "checkpoint image layout of CRI-O and Podman).",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument(
        "--oci",
        required=True,
        type=Path,
        metavar="FILE",
        help="The archive to write (skopeo copy oci-archive:FILE ... pushes it).",
    )
    add_json(p)
    p.set_defaults(handler=export)


def add_import(commands: Any) -> None:
    p = commands.add_parser(
        "import",
        help="Store the checkpoint of an OCI image archive (as "
        "`export` writes it) as a new checkpoint.",
    )
    p.add_argument("archive", type=Path, metavar="FILE")
    p.add_argument(
        "--label", default="", help="Label of the new checkpoint (default: the " "archive's)."
    )
    p.add_argument(
        "--namespace", default="", help="Namespace it belongs to (default: the " "archive's)."
    )
    add_json(p)
    p.set_defaults(handler=import_)


def export(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.store import validate_checkpoint_id

    validate_checkpoint_id(args.checkpoint)
    with Client(settings.socket) as client:
        answer = client.k8s_export(args.checkpoint, str(args.oci.absolute()))
    if args.json:
        output.emit_json(answer)
    else:
        output.say(
            f"checkpoint {args.checkpoint} written to {answer['path']} "
            f"({answer['size_bytes']} bytes, manifest {answer['digest']})"
        )


def import_(args: argparse.Namespace, settings: Settings) -> None:
    with Client(settings.socket) as client:
        answer = client.k8s_import(
            path=str(args.archive.absolute()), label=args.label, namespace=args.namespace
        )
    if args.json:
        output.emit_json(answer)
    else:
        output.say(
            f"checkpoint {answer['checkpoint']} (label {answer['label']}, namespace "
            f"{answer['namespace']}) imported from {args.archive}"
        )
