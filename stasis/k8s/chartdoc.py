"""The chart's README (charts/stasis/README.md), written from its values.yaml: every value,
its default and the comment above it. `python -m stasis.k8s.chartdoc > charts/stasis/README.md`
(`make docs`); tests/k8s/test_chart.py fails when the README is stale.

A comment block directly above a key is that key's description; one above a key whose value is
a mapping of values describes that group (its heading in the table). The defaults come from
YAML itself, so a value is shown as Helm will see it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parents[2] / "charts" / "stasis"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_]+):(?P<rest>.*)$")

_INTRO = """\
# The stasis chart

Checkpoint and restore of the containers that opt in (`runtimeClassName: stasis` and
`STASIS_CHECKPOINT`): a node agent on every node puts the stasis runtime into containerd
and runs the stasis daemon there. How to install and use it:
[docs/install-kubernetes.md](../../docs/install-kubernetes.md).

```sh
helm upgrade -i stasis charts/stasis -n stasis-system --create-namespace \\
    --set image.repository=REGISTRY/stasis/agent \\
    --set siteKey.existingSecret=stasis-site-key --set store.url=s3://bucket/prefix \\
    --set store.s3.existingSecret=stasis-s3
```

## Parameters

<!-- Written by `python -m stasis.k8s.chartdoc` from values.yaml: edit the comments there. -->

| Parameter | Default | Description |
|---|---|---|
"""


def _comments(lines: list[str]) -> list[tuple[str, str, bool]]:
    """(dotted key, its comment, whether the comment is its own) for every key, in order."""
    found: list[tuple[str, str, bool]] = []
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        m = _KEY.match(line)
        if not stripped or m is None:
            block = [] if not stripped else block
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [m["key"]])
        found.append((key, " ".join(block), bool(block)))
        block = []
        stack.append((indent, m["key"]))
    return found


def _get(values: dict[str, Any], dotted: str) -> Any:
    value: Any = values
    for part in dotted.split("."):
        value = value[part]
    return value


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def readme(chart: Path = CHART) -> str:
    import yaml

    text = (chart / "values.yaml").read_text()
    values = yaml.safe_load(text)
    rows = []
    for key, comment, _ in _comments(text.splitlines()):
        value = _get(values, key)
        if isinstance(value, dict) and value:
            if comment:
                rows.append(f"| **`{key}`** | | {_cell(comment)} |")
            continue
        shown = json.dumps(value)
        rows.append(f"| `{key}` | `{_cell(shown)}` | {_cell(comment)} |")
    return _INTRO + "\n".join(rows) + "\n"


def undocumented(chart: Path = CHART) -> list[str]:
    """The values without a comment of their own (each needs one)."""
    import yaml

    text = (chart / "values.yaml").read_text()
    values = yaml.safe_load(text)
    missing = []
    for key, _, own in _comments(text.splitlines()):
        value = _get(values, key)
        if not own and not (isinstance(value, dict) and value):
            missing.append(key)
    return missing


def main() -> None:
    sys.stdout.write(readme())


if __name__ == "__main__":
    main()
