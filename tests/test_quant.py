"""flashdraft/quant/ is the bottom layer: kernels/, layers/, formats/ and models/ import it, and it imports no
other part of flashdraft, at the top of a module or inside a function."""
import ast
from pathlib import Path

import flashdraft.quant

PACKAGE = "flashdraft.quant"
QUANT = Path(flashdraft.quant.__file__).parent


def flashdraft_imports(path: Path) -> list[tuple[int, str]]:
    """(line, name) of everything of flashdraft the module imports anywhere in it, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = PACKAGE.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{module}" if module else base
            names = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "flashdraft"]
    return found


def test_quant_imports_nothing_of_flashdraft_but_itself():
    modules = sorted(QUANT.glob("*.py"))
    assert len(modules) > 1
    outside = [f"{path.name}:{line} imports {name}" for path in modules for line, name in flashdraft_imports(path)
               if not name.startswith(PACKAGE + ".")]
    assert not outside, outside
