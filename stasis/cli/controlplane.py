"""`stasis controlplane ...`: serve the control plane, and its admin commands (clusters, tokens,
nodes), which talk to the one named by STASIS_CONTROLPLANE_URL with STASIS_AUTH_TOKEN."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from stasis.cli import output
from stasis.cli.args import add_json, subcommands
from stasis.config import Settings
from stasis.errors import UsageError

if TYPE_CHECKING:
    from stasis.controlplane.client import ControlPlaneClient
    from stasis.controlplane.commands import Command
    from stasis.controlplane.wire import PolicyEdit


def add_controlplane(commands: Any) -> None:
    top = commands.add_parser(
        "controlplane",
        help="The control plane: serve it, or administer " "the one at STASIS_CONTROLPLANE_URL.",
    )
    sub = subcommands(top)
    # Each flag's default is its setting (controlplane_*, stasis.config: file and environment).
    p = sub.add_parser("serve", help="Run the control plane.")
    p.add_argument(
        "--db",
        default=None,
        help="SQLAlchemy URL (postgresql+psycopg://...) or a SQLite file (default: the "
        "setting controlplane_db, else STATE_DIR/controlplane.db).",
    )
    p.add_argument(
        "--listen", default=None, help="HOST:PORT (default: controlplane_listen, 127.0.0.1:8470)"
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="Where the admin token made at the first start goes (0600; default: "
        "controlplane_admin_token_file, else printed once).",
    )
    p.add_argument(
        "--cert",
        type=Path,
        default=None,
        help="TLS certificate (PEM): HTTPS (default: controlplane_cert).",
    )
    p.add_argument(
        "--key", type=Path, default=None, help="Its private key (PEM; default: controlplane_key)."
    )
    p.add_argument(
        "--allow-plain-http",
        action="store_true",
        default=None,
        help="Serve plain HTTP on a non-loopback address (tokens in the clear; default: "
        "controlplane_serve_plain_http).",
    )
    p.add_argument(
        "--behind-tls",
        action="store_true",
        default=None,
        help="A TLS-terminating proxy is in front: the dashboard's session cookie "
        "is Secure and the installers name https:// even though requests "
        "arrive here over plain HTTP (default: controlplane_behind_tls).",
    )
    p.add_argument(
        "--lost-after",
        type=float,
        default=None,
        metavar="S",
        help="A node silent this long is shown as lost (default: "
        "controlplane_lost_after_s, 60).",
    )
    p.add_argument(
        "--command-lease",
        type=float,
        default=None,
        metavar="S",
        help="Seconds a node holds a command before it is given out again "
        "(default: controlplane_command_lease_s, 60).",
    )
    p.add_argument(
        "--session-ttl",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="How long a dashboard log-in lasts (default: controlplane_session_ttl_s, 8h).",
    )
    p.add_argument(
        "--min-interval",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="The shortest period a policy may have: a shorter --every is refused; also the "
        "floor of --every auto (default: controlplane_min_interval_s, 60s).",
    )
    p.add_argument(
        "--max-interval",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="The ceiling of a policy's --every auto interval, and that interval where a "
        "cluster showed no interruption in 30 days (default: controlplane_max_interval_s, 1d).",
    )
    p.set_defaults(handler=serve)

    p = sub.add_parser(
        "join",
        help="Put a control plane's url, cluster id and token "
        "(STASIS_AUTH_TOKEN) into a node daemon's config file "
        "(what the web installer runs).",
    )
    p.add_argument("--config", type=Path, required=True, help="The config file (0600).")
    p.add_argument(
        "--url",
        required=True,
        help="The control plane's URL (https://HOST:PORT; written as " "controlplane_url).",
    )
    p.add_argument(
        "--cluster-id",
        required=True,
        help="The id of the cluster this node joins (`clusters add` printed it; "
        "written as cluster_id).",
    )
    p.add_argument("--node", default=None, help="This node's name (default: the host name).")
    p.add_argument(
        "--allow-plain-http",
        action="store_true",
        help="Accept an http:// URL off loopback (the token crosses the network in "
        "the clear); writes controlplane_allow_plain_http = true.",
    )
    p.set_defaults(handler=join)

    clusters = subcommands(sub.add_parser("clusters", help="Clusters and their tokens."))
    p = clusters.add_parser(
        "add",
        help="Register a cluster: its id and token (what the Slurm "
        "installer and the Helm chart take).",
    )
    p.add_argument("name")
    p.add_argument(
        "--kind",
        required=True,
        choices=["slurm", "kubernetes"],
        help="Its scheduler: which installer its token fetches.",
    )
    p.add_argument(
        "--expires-in",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="The token stops working this long from now (default: never).",
    )
    p.add_argument(
        "--approve-joins",
        action="store_true",
        help="A node that joins waits (pending: given no command, chosen as no "
        "target) until `stasis controlplane nodes approve NODE`: whoever "
        "steals the cluster token gets no work sent to a node of theirs.",
    )
    _answers(
        p,
        lambda c, a: c.add_cluster(
            {
                "name": a.name,
                "kind": a.kind,
                "expires_in_s": a.expires_in,
                "approve_joins": a.approve_joins,
            }
        ),
        _said_cluster,
    )
    p = clusters.add_parser("list", help="The clusters.")
    _answers(
        p,
        lambda c, a: c.list_clusters(),
        _said_rows("id", "name", "kind", "created", "approve_joins"),
    )
    p = clusters.add_parser("rotate", help="A new token for a cluster; its old ones revoked.")
    p.add_argument("cluster_id", metavar="CLUSTER_ID")
    p.add_argument(
        "--expires-in",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="The new token stops working this long from now (default: never).",
    )
    _answers(p, lambda c, a: c.rotate(a.cluster_id, {"expires_in_s": a.expires_in}), _said_cluster)

    p = clusters.add_parser(
        "set", help="Change a cluster's settings (the nodes joined " "already keep their approval)."
    )
    p.add_argument("cluster", metavar="CLUSTER", help="Its id or name.")
    joins = p.add_mutually_exclusive_group(required=True)
    joins.add_argument(
        "--approve-joins",
        dest="approve_joins",
        action="store_const",
        const=True,
        help="Nodes that join wait for `nodes approve`.",
    )
    joins.add_argument(
        "--no-approve-joins",
        dest="approve_joins",
        action="store_const",
        const=False,
        help="Nodes that join are approved at once.",
    )
    _answers(
        p,
        lambda c, a: c.cluster_settings(a.cluster, {"approve_joins": a.approve_joins}),
        lambda d: output.say(
            f"cluster {d['cluster_id']}: nodes that join "
            + ("wait for an admin's approval" if d["approve_joins"] else "are approved at once")
        ),
    )

    toks = subcommands(sub.add_parser("tokens", help="Tokens (never shown again: ids only)."))
    p = toks.add_parser(
        "list",
        help="Every token's id, kind, cluster, creation, revocation "
        "and expiry (never the token itself).",
    )
    _answers(
        p,
        lambda c, a: c.list_tokens(),
        _said_rows("id", "kind", "cluster_id", "created", "revoked", "expires"),
    )
    p = toks.add_parser(
        "revoke", help="Revoke TOKEN_ID (an id from `tokens list`): it stops " "working at once."
    )
    p.add_argument("token_id", metavar="TOKEN_ID")
    _answers(p, lambda c, a: c.revoke(a.token_id), lambda d: output.say(f"revoked {d['token_id']}"))

    p = sub.add_parser(
        "nodes",
        help="The nodes: ready, not-ready, lost, or pending (joined, "
        "waiting for an admin's approval).",
    )
    _answers(
        p,
        lambda c, a: c.list_nodes(),
        _said_rows(
            "cluster",
            "name",
            "state",
            "approved",
            "jobs",
            "stasis_version",
            "criu_version",
            "last_heartbeat_age_s",
        ),
    )
    node_cmds = subcommands(p, dest="nodes_command", required=False)
    p = node_cmds.add_parser(
        "reset",
        help="Forget NODE's own credential, so that it joins "
        "again with the cluster token (its state dir was "
        "lost, or it is a new machine under that name).",
    )
    _node_arguments(p, "name")
    _answers(
        p,
        lambda c, a: c.reset_node(a.name, {"cluster": a.cluster}),
        lambda d: output.say(
            f"node {d['name']} "
            + (
                "reset: it joins again with the cluster token"
                if d["reset"]
                else "had no credential: it may join"
            )
        ),
    )
    p = node_cmds.add_parser(
        "approve",
        help="Approve NODE, pending since it joined a cluster "
        "added with --approve-joins: from now on it is "
        "given commands and chosen as a target.",
    )
    _node_arguments(p, "name")
    _answers(
        p,
        lambda c, a: c.approve_node(a.name, {"cluster": a.cluster}),
        lambda d: output.say(
            f"node {d['name']} " + ("approved" if d["was_pending"] else "was approved already")
        ),
    )

    p = sub.add_parser("jobs", help="The jobs the nodes report.")
    _answers(p, lambda c, a: c.list_jobs(), _said_jobs)
    p = sub.add_parser(
        "checkpoints",
        help="The checkpoints the nodes reported, newest "
        "first: size, CRIU's time, frozen time, and the "
        "verdict of `stasis verify` (ok, failed: REASON, "
        "not verified).",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=500,
        help="At most this many, newest first (default: %(default)s).",
    )
    p.add_argument("--deleted", action="store_true", help="Deleted ones too.")
    _answers(
        p,
        lambda c, a: c.list_checkpoints(a.limit, a.deleted),
        _said_rows(
            "cluster",
            "node",
            "id",
            "job",
            "label",
            "user",
            "size_bytes",
            "duration_s",
            "frozen_s",
            "reason",
            "age_s",
            "verified",
        ),
    )
    p = sub.add_parser(
        "savings",
        help="Node-hours of work kept by restores instead of " "reruns, per cluster and per user.",
    )
    _answers(p, lambda c, a: c.savings(), _said_savings)
    p = sub.add_parser("actions", help="The commands sent to nodes, and how they went.")
    _answers(
        p,
        lambda c, a: c.list_commands(),
        _said_rows("id", "kind", "node", "state", "attempts", "created", "finished"),
    )
    p = sub.add_parser("checkpoint", help="A checkpoint of JOB, taken by its node's daemon.")
    p.add_argument("job", metavar="JOB")
    _where(p)
    p.add_argument(
        "--stop",
        action="store_true",
        help="Stop the job once it is checkpointed "
        "(a Slurm job: and requeue it; "
        "default: it goes on running).",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="S",
        help="Seconds to wait for the node's answer (default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=checkpoint)
    p = sub.add_parser(
        "verify",
        help="Have the node that took CHECKPOINT verify it (`stasis "
        "verify`: restored in a sandbox, checked, removed); the "
        "verdict is kept with it. Exit 1 when it fails.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        metavar="S",
        help="Seconds to wait for the node's verdict (default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=verify)
    p = sub.add_parser(
        "migrate",
        help="Move JOB to NODE: checkpointed and stopped on its "
        "node, restored on NODE from the store both share.",
    )
    p.add_argument("job", metavar="JOB")
    _where(p)
    p.add_argument(
        "--to",
        required=True,
        metavar="NODE",
        help="The ready node of the job's cluster that restores it.",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="S",
        help="Seconds to wait for each node (default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=migrate)
    p = sub.add_parser(
        "drain",
        help="Move every job off NODE: on a Slurm cluster NODE is "
        "drained in Slurm and its jobs checkpointed and requeued; "
        "on a Kubernetes cluster it is cordoned and its "
        "containers checkpointed and their pods evicted; "
        "stasis's own jobs migrate to the other ready nodes. "
        "Done when the node reports none.",
    )
    _node_arguments(p, "node")
    p.add_argument("--reason", default="stasis drain", help="Slurm's drain reason.")
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        metavar="S",
        help="Seconds to wait for the nodes (default: %(default)s).",
    )
    add_json(p)
    p.set_defaults(handler=drain)
    pol = subcommands(
        sub.add_parser(
            "policies",
            help="Policies: every N seconds, a "
            "checkpoint of matching jobs, retention "
            "of their checkpoints, or a verify of "
            "the newest.",
        )
    )
    p = pol.add_parser("add", help="A new policy (a webhook one prints its hook token, once).")
    p.add_argument("name")
    _policy_options(p, editing=False)
    add_json(p)
    p.set_defaults(handler=add_policy)
    p = pol.add_parser(
        "edit",
        help="Change a policy in place: only the options given change "
        "(a filter given as '' is removed).",
    )
    p.add_argument("name")
    _policy_options(p, editing=True)
    add_json(p)
    p.set_defaults(handler=edit_policy)
    p = pol.add_parser(
        "rotate-hook",
        help="A new hook token for a policy (printed once); the " "old one stops working.",
    )
    p.add_argument("name")
    add_json(p)
    p.set_defaults(
        handler=lambda a, s: _call(
            a, s, lambda c: c.rotate_hook(a.name), lambda d: _said_hook(d, s)
        )
    )
    p = pol.add_parser(
        "list", help="The policies: trigger, period, action, filters, whether " "enabled, last run."
    )
    _answers(
        p,
        lambda c, a: c.list_policies(),
        _said_rows(
            "name",
            "trigger",
            "every_s",
            "action",
            "stop",
            "keep",
            "filters",
            "enabled",
            "hook",
            "last_run",
        ),
    )
    p = pol.add_parser("run", help="Run a policy now (what its webhook does).")
    p.add_argument("name")
    _answers(
        p,
        lambda c, a: c.run_policy(a.name),
        lambda d: output.say(f"policy {d['name']}: " f"{d['queued']} command(s)"),
    )
    p = sub.add_parser("events", help="What happened: nodes joining, commands, policy runs.")
    p.add_argument(
        "--limit",
        type=int,
        default=200,
        help="At most this many, the latest (default: %(default)s).",
    )
    _answers(p, lambda c, a: c.list_events(a.limit), _said_rows("at", "node", "kind", "message"))
    p = pol.add_parser("rm", help="Delete a policy (its hook token stops working).")
    p.add_argument("name")
    _answers(
        p,
        lambda c, a: c.remove_policy(a.name),
        lambda d: output.say(f"policy {d['name']} " "removed"),
    )


def _policy_options(p: argparse.ArgumentParser, editing: bool) -> None:
    """The options of `policies add`, and of `policies edit` where none has a default (what is
    not given does not change)."""
    from stasis.controlplane.routes import RUN_POLICY

    p.add_argument(
        "--every",
        type=_every,
        metavar="N[s|m|h|d]|auto",
        help="Run every N, at least the control plane's floor (serve "
        "--min-interval, 60 s by default); with --on memory: act on a job "
        "again only N later." + (" 0: only when called." if editing else "") + " auto "
        "(--action checkpoint): each job it picks at its own interval, Young/Daly from its "
        "measured checkpoint cost (frozen time) and its cluster's interruption rate (nodes "
        "lost, drains, preemptions per node-hour over 30 days), within serve --min-interval "
        "and --max-interval; `jobs` shows each one's interval and why.",
    )
    p.add_argument(
        "--on",
        choices=["webhook", "memory", "drain"],
        help="webhook: run only when called (`policies run NAME`, "
        f"{RUN_POLICY.method} {RUN_POLICY.url(name='NAME')}, with the admin token or the "
        "policy's hook token); memory: a job above --above PCT of its node's memory; drain: "
        "the jobs of a node its scheduler drains or holds for maintenance.",
    )
    p.add_argument(
        "--above",
        type=float,
        default=None,
        metavar="PCT",
        help="memory: the share of its node's memory that triggers.",
    )
    p.add_argument(
        "--action",
        required=not editing,
        default=None,
        choices=["checkpoint", "retain", "migrate", "verify"],
        help="verify: each matching label's newest checkpoint not verified yet is "
        "verified (`stasis verify`) by the node that took it, at low "
        "priority; filters: --cluster, --node, --label, --user.",
    )
    flag: Any = argparse.BooleanOptionalAction if editing else "store_true"
    p.add_argument(
        "--stop",
        action=flag,
        default=None if editing else False,
        help="checkpoint: and stop the job (a Slurm job: requeue it).",
    )
    p.add_argument(
        "--keep",
        type=int,
        default=None,
        help="retain: the newest checkpoints each label keeps"
        + (" (0: no such limit)." if editing else "."),
    )
    p.add_argument(
        "--completed",
        action=flag,
        default=None if editing else False,
        help="retain: delete every checkpoint of a label whose job completed "
        "(exit 0) and that runs nowhere.",
    )
    p.add_argument(
        "--older-than",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="retain: delete checkpoints older than this (a label's newest stays)"
        + ("; 0: no such limit." if editing else "."),
    )
    for f in _GLOBS:
        p.add_argument(
            f"--{f}",
            default=None if editing else "",
            help=f"Only this {f} (a glob; partition: Kubernetes' namespace too)"
            + ("; '' removes the filter." if editing else "."),
        )
    p.add_argument(
        "--min-age",
        type=_duration,
        default=None,
        metavar="N[s|m|h|d]",
        help="Only jobs that have run this long" + ("; 0 removes the filter." if editing else "."),
    )
    p.add_argument(
        "--min-size",
        type=_size,
        default=None,
        metavar="N[K|M|G]",
        help="Only jobs with this much resident memory"
        + ("; 0 removes the filter." if editing else "."),
    )
    if editing:
        on_off = p.add_mutually_exclusive_group()
        on_off.add_argument(
            "--enable",
            dest="enable",
            action="store_const",
            const=True,
            default=None,
            help="Run the policy again.",
        )
        on_off.add_argument(
            "--disable",
            dest="enable",
            action="store_const",
            const=False,
            help="Keep the policy, but run it no more until --enable.",
        )


_GLOBS = ("cluster", "node", "label", "user", "partition")


def _where(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cluster",
        default=None,
        help="The job's cluster (id or name): needed " "when nodes of several report JOB.",
    )
    p.add_argument(
        "--node", default=None, help="The job's node: needed when several nodes " "report JOB."
    )


def _finished(client: ControlPlaneClient, cmd: Command, wait_s: float) -> dict[str, Any]:
    """The command once its node acknowledged it."""
    import time

    from stasis.errors import CheckpointError

    deadline = time.monotonic() + wait_s
    while cmd["state"] not in ("done", "failed"):
        if time.monotonic() > deadline:
            # Still queued or leased: the control plane will carry it out, retry or re-target
            # it. A restore by hand meanwhile would run the job twice (seen in the soak).
            raise CheckpointError(
                f"node {cmd['node']} has not answered command {cmd['id']} "
                f"within {wait_s:.0f} s; it is still {cmd['state']} and the "
                "control plane goes on with it (retried, re-targeted or "
                "failed naming its checkpoint): do not restore the job by "
                "hand meanwhile; follow it with `stasis controlplane actions`"
            )
        time.sleep(0.3)
        cmd = client.get_command(cmd["id"])
    return cast(dict[str, Any], cmd)  # answered: its result is there


def _restored(client: ControlPlaneClient, first: dict[str, Any], wait_s: float) -> dict[str, Any]:
    """A migration's restore half once answered, following its retries and re-targets (a
    failed restore names the one that follows it, `next`) to the last."""
    then = _finished(client, client.get_command(str(first["result"]["next"])), wait_s)
    for _ in range(50):  # bounded by the control plane's retries; this bounds a hostile one
        nxt = (then.get("result") or {}).get("next")
        if then["state"] != "failed" or not nxt:
            break
        then = _finished(client, client.get_command(str(nxt)), wait_s)
    return then


def migrate(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.errors import CheckpointError, RestoreError

    client = _client(settings)
    first = _finished(
        client,
        client.migrate(
            {"job": args.job, "to": args.to, "cluster": args.cluster, "node": args.node}
        ),
        args.wait,
    )
    if first["state"] == "failed":
        raise CheckpointError(
            f"node {first['node']}: {first['result'].get('error')} (job "
            f"{args.job} goes on there)"
        )
    then = _restored(client, first, args.wait)
    if then["state"] == "failed":
        error = str(then["result"].get("error"))
        ckpt = first["result"]["checkpoint"]
        raise RestoreError(
            f"node {then['node']}: {error}"
            + ("" if ckpt in error else f" (checkpoint {ckpt} is kept: restore it by hand)")
        )
    moved = {
        "job": then["result"]["job"],
        "node": then["node"],
        "checkpoint": first["result"]["checkpoint"],
        "from_job": args.job,
        "from_node": first["node"],
        "commands": [first["id"], then["id"]],
    }
    if args.json:
        output.emit_json(moved)
    else:
        output.say(
            f"job {args.job} on {moved['from_node']} is job {moved['job']} on "
            f"{moved['node']} (checkpoint {moved['checkpoint']})"
        )


def drain(args: argparse.Namespace, settings: Settings) -> None:
    import time

    from stasis.errors import CheckpointError

    client = _client(settings)
    plan = client.drain(args.node, {"reason": args.reason, "cluster": args.cluster})
    moved, failed, requeued = [], [], []
    scheduler = plan["drain"]
    if scheduler:
        drained = _finished(client, scheduler, args.wait)
        if drained["state"] == "failed":
            failed.append(f"drain: {drained['result'].get('error')}")
        else:
            requeued = list(drained["result"].get("requeued") or [])
            failed.extend(drained["result"].get("failed") or [])
    for migration in plan["migrations"]:
        first = _finished(client, migration, args.wait)
        job = first["args"]["job"]
        if first["state"] == "failed":
            failed.append(f"{job}: {first['result'].get('error')}")
            continue
        then = _restored(client, first, args.wait)
        if then["state"] == "failed":
            failed.append(f"{job}: restore on {then['node']}: {then['result'].get('error')}")
            continue
        moved.append(
            {
                "from_job": job,
                "job": then["result"]["job"],
                "node": then["node"],
                "checkpoint": first["result"]["checkpoint"],
            }
        )
    deadline = time.monotonic() + args.wait
    empty = False
    while not empty and not failed and time.monotonic() < deadline:
        jobs = client.list_jobs()
        # (a Slurm job on several nodes is one row: its parts' nodes count too)
        empty = not any(
            args.node in (j["node"], *j.get("nodes", [])) and j["cluster_id"] == plan["cluster_id"]
            for j in jobs
        )
        if not empty:
            time.sleep(0.5)
    done = {
        "node": args.node,
        "moved": moved,
        "requeued": requeued,
        "failed": failed,
        "empty": empty,
        "handled": plan.get("handled") or [],
    }
    if args.json:
        output.emit_json(done)
    else:
        for r in requeued:
            if r.get("pod"):  # Kubernetes: the pod evicted, its controller makes it again
                output.plain(
                    f"container {r['job']} checkpointed ({r['checkpoint']}), pod "
                    f"{r['pod']} evicted"
                )
            else:
                output.plain(
                    f"Slurm job {r['job']} checkpointed ({r['checkpoint']}) and " "requeued"
                )
        for m in moved:
            output.say(f"job {m['from_job']} is job {m['job']} on {m['node']}")
        output.say(f"node {args.node} is " + ("empty" if empty else "not empty yet"))
    if failed:
        raise CheckpointError(
            f"{len(failed)} job(s) could not be moved off {args.node}: " + "; ".join(failed)
        )


def checkpoint(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.errors import CheckpointError

    client = _client(settings)
    cmd = _finished(
        client,
        client.new_command(
            {
                "kind": "checkpoint",
                "job": args.job,
                "leave_running": not args.stop,
                "cluster": args.cluster,
                "node": args.node,
            },
        ),
        args.wait,
    )
    if args.json:
        output.emit_json(cmd)
    if cmd["state"] == "failed":
        raise CheckpointError(f"node {cmd['node']}: {cmd['result'].get('error')}")
    if not args.json:
        r = cmd["result"]
        output.say(
            f"checkpoint {r['checkpoint']} of job {args.job} on node {cmd['node']} "
            f"(label {r['label']})"
        )


def verify(args: argparse.Namespace, settings: Settings) -> None:
    import time

    from stasis.errors import RestoreError

    client = _client(settings)
    cmd = client.verify_checkpoint(args.checkpoint)
    deadline = time.monotonic() + args.wait
    while cmd["state"] not in ("done", "failed"):
        if time.monotonic() > deadline:
            raise RestoreError(
                f"node {cmd['node']} has not answered verify {cmd['id']} of "
                f"checkpoint {args.checkpoint} within {args.wait:.0f} s; it "
                f"is still {cmd['state']}: its verdict will show in `stasis "
                "controlplane checkpoints`"
            )
        time.sleep(0.3)
        cmd = client.get_command(cmd["id"])
    verdict = (cmd["result"] or {}).get("verdict")
    if args.json:
        output.emit_json(cmd)
    if not isinstance(verdict, dict):
        raise RestoreError(
            f"node {cmd['node']} could not verify checkpoint {args.checkpoint}: "
            f"{(cmd['result'] or {}).get('error')}"
        )
    if not verdict.get("ok"):
        raise RestoreError(
            f"checkpoint {args.checkpoint} failed verification on node "
            f"{cmd['node']}: {verdict.get('reason')}"
        )
    if not args.json:
        output.say(
            f"checkpoint {args.checkpoint} verified on node {cmd['node']}: it restores "
            f"({verdict.get('processes')} process(es) in "
            f"{float(verdict.get('duration_s') or 0):.1f} s)"
        )


def _duration(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        return int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90s, 10m, 1h)") from None


def _every(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else _duration(text)


def _said_jobs(rows: list[dict[str, Any]]) -> None:
    keys = ("cluster", "node", "job", "label", "user", "state", "last_checkpoint_age_s")
    output.plain("\t".join((*keys, "parts", "interval_s", "why")))
    for r in rows:
        shown = r.get("interval") or {}
        cells = ["" if r.get(k) is None else str(r.get(k)) for k in keys]
        # A Slurm job on several nodes (one row): NODE:KEY of each part, its batch node's
        # in `node` ("" while no node reports its batch step).
        if r.get("parts") is not None and r.get("batch_node") is None:
            cells[1] = ""
        cells.append(",".join(f"{p['node']}:{p['key']}" for p in r.get("parts") or []))
        interval_s = shown.get("interval_s")
        cells += ["" if interval_s is None else f"{interval_s:.1f}", str(shown.get("why", ""))]
        output.plain("\t".join(cells))


def _size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text[:-1], text[-1:].upper()
    if unit.isdigit():
        number, unit = text, ""
    if not number.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: a number with K, M, G or T")
    return int(number) * units[unit]


def _seg(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def _client(settings: Settings) -> ControlPlaneClient:
    from stasis.controlplane.client import ControlPlaneClient

    return ControlPlaneClient(
        settings.controlplane_url,
        settings.auth_token,
        allow_plain_http=settings.controlplane_allow_plain_http,
    )


def _call(
    args: argparse.Namespace,
    settings: Settings,
    ask: Callable[[ControlPlaneClient], Any],
    say: Callable[[Any], object],
) -> None:
    """`ask`: one call of the client's (a method per route), its answer said or printed."""
    answer = ask(_client(settings))
    if args.json:
        output.emit_json(answer)
    else:
        say(answer)


def _node_arguments(p: argparse.ArgumentParser, dest: str) -> None:
    """NODE (as `dest`), and --cluster for where several clusters have a node of that name."""
    p.add_argument(dest, metavar="NODE")
    p.add_argument(
        "--cluster",
        default=None,
        help="Its cluster's id or name (needed when " "several clusters have a node NODE).",
    )


def _answers(
    p: argparse.ArgumentParser,
    ask: Callable[[ControlPlaneClient, argparse.Namespace], Any],
    say: Callable[[Any], object],
) -> None:
    """`p`'s command is one call of the client's, `ask` (with its arguments), its answer said by
    `say`, or printed with --json."""
    add_json(p)
    p.set_defaults(handler=lambda a, s: _call(a, s, lambda c: ask(c, a), say))


def _said_cluster(d: dict[str, Any]) -> None:
    output.plain(
        f"cluster {d.get('name', d['cluster_id'])}: id {d['cluster_id']}\n"
        f"token (shown once): {d['token']}"
        + (
            "\nnodes that join wait for `stasis controlplane nodes approve NODE`"
            if d.get("approve_joins")
            else ""
        )
    )


def _said_savings(d: dict[str, Any]) -> None:
    output.say(f"{d['node_hours']:.3f} node-hours of work kept by {d['restores']} restore(s)")
    for c in d["clusters"]:
        output.say(f"  cluster {c['cluster']}: {c['node_hours']:.3f}")
    if "spent_node_hours" in d:  # an older control plane says only what was kept
        output.say(
            f"{d['spent_node_hours']:.4f} node-hours spent checkpointing (frozen time x "
            f"nodes): net {d['net_node_hours']:.3f} kept"
        )
        for c in d["per_cluster"]:
            rate = (
                f"{c['rate_per_node_hour']:.3g} interruptions per node-hour "
                f"({c['interruptions']} in {c['node_hours_seen']:.1f}, 30 days)"
                if c["interruptions"]
                else "no interruption seen in 30 days"
            )
            output.say(
                f"  cluster {c['cluster']}: kept {c['kept_node_hours']:.3f}, spent "
                f"{c['spent_node_hours']:.4f}, net {c['net_node_hours']:.3f}; {rate}"
            )
    for u in d["users"]:
        output.say(f"  user {u['user']}: {u['node_hours']:.3f}")


def _said_rows(*keys: str) -> Any:
    def say(rows: list[dict[str, Any]]) -> None:
        output.plain("\t".join(keys))
        for r in rows:
            output.plain("\t".join("" if r.get(k) is None else str(r.get(k)) for k in keys))

    return say


def add_policy(args: argparse.Namespace, settings: Settings) -> None:
    a = args
    if a.every is None and a.on is None:
        raise UsageError("say when: --every N or --on webhook|memory|drain")
    if a.on in ("webhook", "drain") and a.every is not None:
        raise UsageError(
            f"--every with --on {a.on}: a {a.on} policy runs when it is called "
            "or triggered, not every N"
        )
    _call(
        a,
        settings,
        lambda c: c.add_policy(
            {
                "name": a.name,
                "every_s": a.every or 0,
                "action": a.action,
                "keep": a.keep,
                "older_than_s": a.older_than,
                "stop": a.stop,
                "completed": a.completed,
                "trigger": a.on if a.on in ("memory", "drain") else "every",
                "threshold_pct": a.above,
                "filters": {
                    **{f: getattr(a, f) for f in _GLOBS if getattr(a, f)},
                    **({"min_age_s": str(a.min_age)} if a.min_age else {}),
                    **({"min_rss_bytes": str(a.min_size)} if a.min_size else {}),
                },
            }
        ),
        lambda d: _said_policy(d, "added", settings),
    )


def edit_policy(args: argparse.Namespace, settings: Settings) -> None:
    a = args
    body: dict[str, Any] = {}
    if a.on is not None:
        if a.on in ("webhook", "drain") and a.every is not None:
            raise UsageError(
                f"--every with --on {a.on}: a {a.on} policy runs when it is "
                "called or triggered, not every N"
            )
        body["trigger"] = "every" if a.on == "webhook" else a.on
        if a.on in ("webhook", "drain"):
            body["every_s"] = 0
    for key, value in (
        ("every_s", a.every),
        ("threshold_pct", a.above),
        ("action", a.action),
        ("stop", a.stop),
        ("completed", a.completed),
        ("enabled", a.enable),
    ):
        if value is not None:
            body[key] = value
    for key, value in (("keep", a.keep), ("older_than_s", a.older_than)):
        if value is not None:
            body[key] = value or None  # 0: no such limit
    filters = {f: getattr(a, f) for f in _GLOBS if getattr(a, f) is not None}
    if a.min_age is not None:
        filters["min_age_s"] = str(a.min_age) if a.min_age else ""
    if a.min_size is not None:
        filters["min_rss_bytes"] = str(a.min_size) if a.min_size else ""
    if filters:
        body["filters"] = filters
    if not body:
        raise UsageError(
            f"nothing to change in policy {a.name}: give what changes (--every, "
            "--on, --action, a filter, ...; `policies edit -h`)"
        )
    _call(
        a,
        settings,
        lambda c: c.edit_policy(a.name, cast("PolicyEdit", body)),
        lambda d: _said_policy(d, "saved", settings),
    )


def _said_policy(d: dict[str, Any], done: str, settings: Settings) -> None:
    output.plain(f"policy {d['name']} {done}")
    if d.get("hook_token"):
        _said_hook(d, settings)


def _said_hook(d: dict[str, Any], settings: Settings) -> None:
    import shlex

    from stasis.controlplane.routes import RUN_POLICY

    url = settings.controlplane_url.rstrip("/") + RUN_POLICY.url(name=d["name"])
    output.plain(
        f"hook token (shown once; it runs policy {d['name']} only): "
        f"{d['hook_token']}\n"
        f"  curl -fsS -X POST -H {shlex.quote('Authorization: Bearer ' + d['hook_token'])}"
        f" {shlex.quote(url)}"
    )


def join(args: argparse.Namespace, settings: Settings) -> None:
    from stasis.controlplane.client import check_url
    from stasis.controlplane.installer import join as write

    if not settings.auth_token:
        raise UsageError(
            "give the cluster's token in STASIS_AUTH_TOKEN (not on the command "
            "line: other users see arguments)"
        )
    # Allowed here (flag or setting): said in the file too, or the daemon refuses the URL.
    plain = args.allow_plain_http or settings.controlplane_allow_plain_http
    check_url(args.url, plain)
    keys = write(args.config, args.url, args.cluster_id, settings.auth_token, args.node, plain)
    output.say(f"{args.config}: {', '.join(keys)} written; restart the node daemon to join")


def serve(args: argparse.Namespace, settings: Settings) -> None:
    import asyncio
    import logging

    from stasis.controlplane.options import ServerOptions
    from stasis.controlplane.server import serve as run

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s stasis-controlplane %(levelname)s %(message)s"
    )

    def given(flag: Any, setting: Any) -> Any:
        return setting if flag is None else flag

    def path(flag: Path | None, setting: str) -> Path | None:
        return flag if flag is not None else (Path(setting) if setting else None)

    db = args.db or settings.controlplane_db or str(settings.state_dir / "controlplane.db")
    try:
        asyncio.run(
            run(
                db,
                given(args.listen, settings.controlplane_listen),
                path(args.admin_token_file, settings.controlplane_admin_token_file),
                path(args.cert, settings.controlplane_cert),
                path(args.key, settings.controlplane_key),
                bool(given(args.allow_plain_http, settings.controlplane_serve_plain_http)),
                ServerOptions(
                    lost_after_s=float(given(args.lost_after, settings.controlplane_lost_after_s)),
                    lease_s=float(given(args.command_lease, settings.controlplane_command_lease_s)),
                    session_ttl_s=int(given(args.session_ttl, settings.controlplane_session_ttl_s)),
                    cache_dir=settings.state_dir / "controlplane",
                    min_interval_s=int(
                        given(args.min_interval, settings.controlplane_min_interval_s)
                    ),
                    behind_tls=bool(given(args.behind_tls, settings.controlplane_behind_tls)),
                    max_interval_s=int(
                        given(args.max_interval, settings.controlplane_max_interval_s)
                    ),
                ),
            )
        )
    except KeyboardInterrupt:
        pass
