"""The README's code blocks are tests: every Python block compiles, and the blocks marked
``<!-- readme-test: run topics=a,b -->`` run as programs against the session's broker.

Running a block: its broker URLs are replaced by the session's, and each topic named in the
marker (as a quoted literal) by a fresh one, so runs never see each other's data.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.broker import REPO, Broker

README = REPO / "README.md"
_BLOCK = re.compile(
    r"(?:<!-- readme-test: run(?: topics=(?P<topics>[\w,.-]+))? -->\n)?```python\n(?P<code>.*?)```",
    re.DOTALL,
)
DEFAULT_SERVICE_URL = "pulsar://127.0.0.1:6650"
DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"


@dataclass(frozen=True)
class Block:
    line: int
    code: str
    run: bool
    topics: tuple[str, ...]

    def __str__(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(path: Path = README) -> list[Block]:
    text = path.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        marked = match.group(0).startswith("<!--")
        topics = tuple(t for t in (match.group("topics") or "").split(",") if t)
        line = text.count("\n", 0, match.start("code"))
        blocks.append(Block(line, match.group("code"), marked, topics))
    return blocks


BLOCKS = readme_blocks()


def test_the_readme_shows_each_use() -> None:
    """An asyncio app, PulsarMap as a key-value store and Spark each have a runnable example."""
    runnable = [b.code for b in BLOCKS if b.run]
    assert any("SharedStateManager" in code for code in runnable)
    assert any("PulsarMap" in code for code in runnable)
    assert any("recipes.spark" in code for code in runnable)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_block_compiles(block: Block) -> None:
    # Fragments may use top-level await; they must still be valid Python.
    compile(block.code, str(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def prepared(block: Block, broker: Broker) -> str:
    code = block.code.replace(DEFAULT_SERVICE_URL, broker.service_url)
    code = code.replace(DEFAULT_ADMIN_URL, broker.admin_url)
    suffix = uuid.uuid4().hex[:8]
    for topic in block.topics:
        quoted = f'"{topic}"'
        assert quoted in code, f"{block}: marker names topic {topic!r}, not in the block"
        code = code.replace(quoted, f'"readme-{topic}-{suffix}"')
    return code


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.run], ids=str)
def test_block_runs(block: Block, broker: Broker, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(prepared(block, broker))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # Spark's Python workers must run this interpreter (it has the project installed).
    env = {**os.environ, "PYTHONPATH": path, "PYSPARK_PYTHON": sys.executable}
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{block} exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-5000:]}"
    )
