"""The configuration reference (docs/configuration.md), written from the declarations of
stasis/config.py: every setting, its area, environment variables, default and what it does.
`python -m stasis.configdoc > docs/configuration.md` (`make docs`); tests/test_docs.py fails when
the page differs from what this prints, so a setting cannot exist without its entry.

Never imported by `stasis` itself: the CLI reads the settings, not their documentation.
"""

from __future__ import annotations

import sys

from stasis.config import AREAS, DEPRECATED_ENV, SETTINGS, Settings, env_name

HEADER = """\
# Configuration

Generated from the declarations of `stasis/config.py` by `python -m stasis.configdoc`
(`make docs`); do not edit by hand: `tests/test_docs.py` fails when this page and the
declarations differ.

One file (`/etc/stasis/config.toml`, or the file `STASIS_CONFIG` names) and environment
variables, read by the daemon, the CLI and the control plane alike; the environment wins over the
file, the file over the defaults (the S3 settings are the exception: the file's values win over
AWS's variables). A setting's variable is `STASIS_` and its name in capitals, but for the few
named otherwise below. In the file a setting is a top-level key or a key of its area's table
(the `[name]` beside each heading below); a key that is no setting, one under another area's
table, or a value of the wrong kind, is refused in one line. Restart the daemon after a change
(`systemctl restart stasis`: jobs keep running, see [operations.md](operations.md)).

```toml
# /etc/stasis/config.toml: a node of a site that shares an S3 store
slurm_remote_port = 6821

[storage]
store = "s3://checkpoints/site-a"
site_key = "/etc/stasis/site.key"
s3_endpoint_url = "https://s3.example.org"
s3_access_key_id = "..."
s3_secret_access_key_file = "/etc/stasis/s3-secret"   # root-only; holds the secret
```
"""

FOOTER = """\
## Variables a job or container sets

Not settings of the node, but read from a job's or a container's own environment:
`STASIS_ENABLE` and `STASIS_CHECKPOINT` (Slurm: opt in, and the label; `CEDANA_ENABLE` /
`CEDANA_CHECKPOINT` work too), `STASIS_CHECKPOINT` (containers), `STASIS_INTERVAL` (periodic
leave-running checkpoints: seconds, `auto` or `off`; unset: the node's `interval`), `STASIS_FRESH` (`1`, `true`, `yes` or `if-unreachable`:
start from the beginning when nobody can tell whether there is a checkpoint; see
[faults.md](faults.md)). The chart's values are in `charts/stasis/values.yaml`
([install-kubernetes.md](install-kubernetes.md)).
"""


def default_cell(value: object) -> str:
    """A default as the table shows it: as it is written in the file."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, tuple):
        return "none" if not value else f"`{':'.join(value)}`"
    if isinstance(value, str) and not value:
        return '`""`'
    return f"`{value}`"


def environment_cell(name: str) -> str:
    own = env_name(name)
    cells = [f"`{own}`"] if own else ["- (the file only)"]
    cells += [f"`{old}` (deprecated)" for old, key in DEPRECATED_ENV.items() if key == name]
    return ", ".join(cells)


def render() -> str:
    parts = [HEADER]
    defaults = Settings._field_defaults
    for area in AREAS:
        parts.append(f"\n## {area.title}: `[{area.key}]`\n\n")
        if area.note:
            parts.append(f"{area.note}\n\n")
        parts.append("| setting | environment | default | what it does |\n|---|---|---|---|\n")
        for name, setting in SETTINGS.items():
            if setting.area == area:
                doc = " ".join(setting.doc.split())
                parts.append(
                    f"| `{name}` | {environment_cell(name)} | {default_cell(defaults[name])} "
                    f"| {doc} |\n"
                )
    if DEPRECATED_ENV:
        olds = ", ".join(f"`{old}`" for old in DEPRECATED_ENV)
        parts.append(
            f"\nThe deprecated variables ({olds}) are still read, with a one-line warning; "
            "the current name wins when both are set.\n"
        )
    parts.append("\n" + FOOTER)
    return "".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
