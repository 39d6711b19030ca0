"""stasis: checkpoint and restore running jobs with CRIU, from the scheduler's side.

Sub-packages, each owning one thing (dependencies point downwards only):

    cli       the `stasis` command; talks to the daemon over its unix socket
    slurm     the Slurm integration: plugins, installer, launcher, the daemon's /slurm side
    daemon    the root node daemon: runs jobs, checkpoints and restores them; integrations
              plug into it (daemon/integration.py)
    client    the daemon's client: one typed method per route
    engine    drives CRIU over its RPC protocol; the only code that starts `criu`
    store     checkpoint images + manifests on a directory or an fsspec URL
    config    one Settings object from a file plus STASIS_* environment variables
    layout    every path under the state directory
    wire      the API's requests and answers as typed dicts
    poll      the one polling loop
    errors    the StasisError tree
"""

from stasis.errors import StasisError

__all__ = ["StasisError", "__version__"]
__version__ = "0.1.0"
