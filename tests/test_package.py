"""The package surface: type checkers see every public name, each resolves, `import tilewise` stays light."""

import ast
import subprocess
import sys
from pathlib import Path

import tilewise

INIT = Path(tilewise.__file__)


def _type_checking_imports(source: str) -> dict[str, str]:
    """name -> module (relative to the package, as _EXPORTS writes it) of the `if TYPE_CHECKING:` imports."""
    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.unparse(imp)
                for alias in imp.names:
                    name = alias.asname or alias.name
                    assert name not in found, f"{name} is imported twice in the TYPE_CHECKING block"
                    found[name] = imp.module
    return found


def _problems(exports: dict[str, str], source: str) -> list[str]:
    """What the TYPE_CHECKING block of `source` gets wrong about `exports` (name -> module)."""
    seen = _type_checking_imports(source)
    out = [f"{n}: not in the TYPE_CHECKING block" for n in sorted(set(exports) - set(seen))]
    out += [f"{n}: in the TYPE_CHECKING block, not in _EXPORTS" for n in sorted(set(seen) - set(exports))]
    out += [f"{n}: imported from .{seen[n]}, _EXPORTS says .{m}" for n, m in sorted(exports.items())
            if n in seen and seen[n] != m]
    return out


def test_type_checking_block_names_every_export_from_its_module():
    assert _problems(tilewise._EXPORTS, INIT.read_text()) == []


def test_a_missing_name_or_another_module_is_caught():
    source = ("if TYPE_CHECKING:\n"
              "    from .geometry import Tile, weight_window\n")
    exports = {"Tile": "geometry", "TileGrid": "geometry", "weight_window": "blending"}
    assert _problems(exports, source) == ["TileGrid: not in the TYPE_CHECKING block",
                                          "weight_window: imported from .geometry, _EXPORTS says .blending"]


def test_every_export_resolves_and_all_lists_them():
    assert tilewise.__all__ == sorted(tilewise._EXPORTS)
    code = "import tilewise\nfor name in tilewise.__all__:\n    getattr(tilewise, name)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_import_tilewise_does_not_import_torch():
    heavy = "('torch', 'diffusers', 'numpy', 'matplotlib')"
    code = f"import sys, tilewise; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
