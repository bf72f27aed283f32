"""What each GPU kernel of a profile computes: HLO instruction -> shape, op and our source lines.

A profiler trace names kernels by HLO instruction (`loop_add_fusion_3`, `gemm_fusion_dot_610`) or
by library kernel (`nvjet_sm90_...`, one name for many different products); each event also
carries its instruction (`hlo_op`). The optimized HLO text of the same executable has, per
instruction, its shape and metadata: the jax op name and a stack frame id whose frames (file,
line, function; the text's StackFrames / FileLocations tables, or older source_file /
source_line fields) lead back to the model code that emitted it. `describe` turns an instruction
into "shape op @ gdn.py:112 project < target.py:90 __call__", which groups a step's ~1300
kernels into the few dozen places in our code they come from.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# frames from these files are ours; jax / flax frames in between are skipped
OWN_FILES = ("ddtree_jax/", "pallas_kernels/", "converters/", "scripts/")

_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELDS = re.compile(r"(\w+)=(\"[^\"]*\"|[-\w.]+)")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) (\w[\w-]*)\(")  # tuple shapes too
_META = re.compile(r"metadata=\{([^}]*)\}")


class Instruction(NamedTuple):
    shape: str  # e.g. "bf16[1,65,16384]"
    opcode: str  # fusion, custom-call, dot, ...
    op_name: str  # jax's name stack, e.g. "jit(f)/while/body/dot_general"
    frames: tuple[str, ...]  # "file:line function", innermost first, ours only


def _strip_layout(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)


def _parse_tables(text: str):
    """FileNames, FunctionNames, FileLocations and StackFrames of an HLO module's text."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None:
            continue
        m = _TABLE_ROW.match(line)
        if m is None:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    return tables


def _frame_stacks(tables) -> dict[int, tuple[str, ...]]:
    """stack frame id -> ("file:line function", ...) innermost first."""
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = dict(_FIELDS.findall(v))
        locs[k] = (files.get(int(f.get("file_name_id", 0)), "?"), int(f.get("line", 0)),
                   funcs.get(int(f.get("function_name_id", 0)), "?"))
    frames = {k: dict(_FIELDS.findall(v)) for k, v in tables.get("StackFrames", {}).items()}

    def stack(fid: int) -> tuple[str, ...]:
        out, seen = [], set()
        while fid and fid in frames and fid not in seen:
            seen.add(fid)
            fr = frames[fid]
            file, line, func = locs.get(int(fr.get("file_location_id", 0)), ("?", 0, "?"))
            out.append(f"{file}:{line} {func}")
            parent = int(fr.get("parent_frame_id", 0))
            fid = parent if parent != fid else 0
        return tuple(out)

    return {fid: stack(fid) for fid in frames}


def _own(frames, own_files=OWN_FILES) -> tuple[str, ...]:
    """Our frames only, with paths cut to the part from the package directory on."""
    out = []
    for fr in frames:
        for key in own_files:
            i = fr.find(key)
            if i >= 0:
                out.append(fr[i:])
                break
    return tuple(out)


def index_hlo(text: str, own_files=OWN_FILES) -> dict[str, Instruction]:
    """Every instruction of an optimized HLO module's text (all computations), by name."""
    stacks = _frame_stacks(_parse_tables(text))
    out = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        name, shape, opcode = m.groups()
        meta = _META.search(line)
        fields = dict(_FIELDS.findall(meta.group(1))) if meta else {}
        op_name = fields.get("op_name", "").strip('"')
        if "stack_frame_id" in fields:
            frames = stacks.get(int(fields["stack_frame_id"]), ())
        elif "source_file" in fields:
            frames = (f"{fields['source_file'].strip(chr(34))}:{fields.get('source_line', '0')}",)
        else:
            frames = ()
        out[name] = Instruction(_strip_layout(shape), opcode, op_name, _own(frames, own_files))
    # kernel names write an instruction's '.' as '_': index those spellings too (exact names win)
    for name in list(out):
        out.setdefault(name.replace(".", "_"), out[name])
    return out


def lookup(index: dict[str, Instruction], hlo_op: str) -> Instruction | None:
    """The instruction a trace event (its hlo_op, or its kernel name) names."""
    return index.get(hlo_op) or index.get(hlo_op.replace(".", "_"))


def describe(inst: Instruction | None, depth: int = 3) -> str:
    """One line: shape, the last two parts of the op name, and up to `depth` of our frames."""
    if inst is None:
        return "?"
    op = "/".join(p for p in inst.op_name.split("/")[-2:] if p) or inst.opcode
    where = " < ".join(fr.rsplit("/", 1)[-1] for fr in inst.frames[:depth])
    return f"{inst.shape} {op}" + (f" @ {where}" if where else "")
