# Optional dependency (GPU and parity tools), absent from requirements/cpu.lock: every name in it is Any
# (pyproject.toml, [tool.basedpyright], says why these stubs exist).
from typing import Any

def __getattr__(name: str) -> Any: ...
