"""``import _paths`` for the scripts of this folder: runs ../_paths.py, the one place tools/ sets ``sys.path``."""

from pathlib import Path

_shared = Path(__file__).resolve().parents[1] / "_paths.py"
exec(compile(_shared.read_text(), str(_shared), "exec"))
