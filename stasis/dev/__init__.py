"""The test bench and the demos: never shipped on a production node; nothing in the product
imports it (import-linter: `stasis.dev` is the top layer, above `stasis.cli`).

    slurmcluster     `stasis-dev local-cluster up|down|status|exec|kill-node|start-node`: a
                     throwaway Slurm cluster of one node or several for tests, benches and demos
    slurmcgroup      that cluster's cgroup Slurm (`local-cluster up --cgroup`)
    slurmaccounting  that cluster's slurmdbd and MariaDB (`local-cluster up --accounting`)
    slurmdirs        that cluster's directories and state file (SlurmClusterDirs)
    k8snode          `stasis-dev local-node up|down`: a private containerd with the stasis
                     runtime and a daemon, as a Kubernetes node runs them
    nodehost         a node as a host of its own on this machine (namespaces, a private bridge)
    commands         how the harnesses run the machine's tools; the ports their services take
    demo, demojob    `make demo` (`stasis-dev demo`): checkpoint, kill, restore a counting job
    slurmdemo        the preemption demo `make demo` ends with
    cli              the `stasis-dev` command (`python -m stasis.dev`)
"""
