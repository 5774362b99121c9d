"""Source lines: which frames are the user's, and the line of user code an equation or an error names.

A frame is the user's (or a model library's) when its code lies outside torch and stagetorch
(:func:`is_internal_file`); :func:`user_frame` finds the innermost such frame, :func:`source_info` makes it
an equation's :class:`~stagetorch.ir.SourceInfo`, and :func:`code_line` quotes its line for an error message.
Code that stands in for stagetorch's own (a test's counting wrapper) is marked so with :func:`mark_internal`.

What it must not know: tensors, the trace, or what an error says.
"""

from __future__ import annotations

import linecache
import os
import sys
import types

import torch

from ..ir import SourceInfo

__all__ = ["user_frame", "is_user_code", "mark_internal", "source_info", "code_line", "is_internal_file"]


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The package root (this module sits one folder down): every module of stagetorch is its own code.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USER_FILES_IN_PACKAGE = ("demo.py",)


def is_internal_file(path: str) -> bool:
    if path.startswith(_TORCH_DIR) or path.startswith("<frozen"):
        return True
    return path.startswith(_OWN_DIR) and os.path.basename(path) not in _USER_FILES_IN_PACKAGE


_INTERNAL_CODE: dict[types.CodeType, bool] = {}


def user_frame(depth: int = 1) -> types.FrameType | None:
    """The innermost frame outside torch and stagetorch: the line of user (or model library) code."""
    f = sys._getframe(depth)
    while f is not None:
        code = f.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            internal = _INTERNAL_CODE[code] = is_internal_file(code.co_filename)
        if not internal:
            return f
        f = f.f_back
    return None


def is_user_code(code: types.CodeType) -> bool:
    """Whether ``code`` is user (or model library) code: outside torch and stagetorch."""
    internal = _INTERNAL_CODE.get(code)
    if internal is None:
        internal = _INTERNAL_CODE[code] = is_internal_file(code.co_filename)
    return not internal


def mark_internal(code: types.CodeType) -> None:
    """Count ``code`` as stagetorch's own: :func:`user_frame` looks past its frames (a wrapper that stands in
    for a stagetorch method, such as a test's counting wrapper, is not the user's line)."""
    _INTERNAL_CODE[code] = True


def source_info(module: str = "", backward: str = "") -> SourceInfo:
    f = user_frame(2)
    if f is None:
        return SourceInfo(module=module, backward=backward)
    return SourceInfo(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, module, backward)


def code_line(src: SourceInfo) -> str:
    text = linecache.getline(src.file, src.line).strip()
    return f"\n    {text}" if text else ""
