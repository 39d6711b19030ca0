"""The Kubernetes integration: containers run by containerd's runc shim that resume from their
last checkpoint.

A container opts in with `STASIS_CHECKPOINT=<label>` in its environment (`CEDANA_CHECKPOINT`
too) and the stasis runtime (a RuntimeClass whose handler is containerd's runtime entry
`stasis`). That entry starts containerd's own runc shim with `stasis-runc` in front of runc
(`runtime`): `create` becomes a restore of the label's newest checkpoint when there is one, the
stop signal is preceded by a checkpoint, and every other runc command goes to runc unchanged.

    runc.py          runc's command line: pause, checkpoint, restore, kill, state; the bundle
    rootfs.py        the container's writable layer: captured with a checkpoint, put back
    runtime.py       the `stasis-runc` wrapper the shim runs instead of runc
    containers.py    the daemon's side: checkpoint a container, prepare its restore, intervals
    integration.py   the daemon's /k8s/ routes
    source.py        the containers as the control plane's jobs (kind "container"): listed,
                     checkpointed, and the node's drain (cordon, checkpoints, evictions)
    kube.py          the Kubernetes API calls of the agent and the daemon
    agent.py         `stasis k8s agent`, the chart's DaemonSet: runtime, taint, cordon, pods
    shim.py          containerd's runtime entry and shim script, as a node gets them

The private containerd of the tests and demos is stasis.dev's (`stasis-dev local-node`).
"""
