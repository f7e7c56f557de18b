"""The snippets of the metrics guide run as written."""

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_guide_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 8
    for index, block in enumerate(blocks):
        namespace: dict = {}
        try:
            exec(compile(block, f"{GUIDE.name}[block {index}]", "exec"), namespace)
        except Exception as error:  # name the failing block
            raise AssertionError(f"snippet {index} of {GUIDE.name} failed:\n{block}") from error
