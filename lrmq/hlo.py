"""Reading compiled HLO text (`compiled.as_text()`): computations, while loops, and the collectives a loop runs;
and the GPU kernels of an XLA dump (`gpu_kernels`: each kernel's PTX target, tensor-core instructions, launch
shape and shared memory, `ptxas_info` its registers and spills).

Used to prove layouts from ahead-of-time compiles (no device needed): e.g. that the generation engine's
decode loop gathers no weights per token (tests/test_paged_tpu.py) and how many bytes its collectives move
per decode step (benchmarks/decode_tpu.py). The parser reads the text format XLA prints for compiled
modules (`%name (params) -> type {` ... `}` per computation, one instruction per line); it is deliberately
small and fails loudly (ValueError) rather than guessing when the text does not look like that.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_CALLEES = re.compile(r"\b(?:calls|body|condition|to_apply|branch_computations|called_computations)="
                      r"(\{[^}]*\}|%[\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")


@dataclass
class Instruction:
    name: str
    op: str  # e.g. "all-gather", "all-gather-start", "while", "fusion"
    type: str  # the result type as printed (may be a tuple)
    line: str

    @property
    def callees(self) -> list[str]:
        out = []
        for m in _CALLEES.finditer(self.line):
            out += [n.strip().lstrip("%") for n in m.group(1).strip("{}").split(",") if n.strip()]
        return out

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=(%[\w.\-]+)", self.line)
        return m.group(1).lstrip("%") if m else None


def array_bytes(type_text: str) -> list[int]:
    """Bytes of every array in a printed type ("bf16[2,8]{1,0:T(8,128)}", or a tuple of them)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(n * _BYTES[dtype]))
    return out


def array_shapes(type_text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dtype, dims in _ARRAY.findall(type_text)
            if dtype in _BYTES]


class Module:
    """The computations of a compiled module's text."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.entry: str | None = None
        current = None
        for line in text.splitlines():
            if current is None:
                m = _HEADER.match(line)
                if m:
                    current = m.group(2)
                    self.computations[current] = []
                    if m.group(1):
                        self.entry = current
                continue
            if line.strip() == "}":
                current = None
                continue
            m = _INSTR.match(line)
            if m:
                self.computations[current].append(Instruction(m.group(2), m.group(4), m.group(3), line))
        if self.entry is None:
            raise ValueError("no ENTRY computation in this HLO text")

    def whiles(self, computation: str | None = None) -> list[Instruction]:
        return [i for i in self.computations[computation or self.entry] if i.op == "while"]

    def reachable(self, root: str) -> set[str]:
        """`root` and every computation it calls, transitively."""
        seen, todo = set(), [root]
        while todo:
            c = todo.pop()
            if c in seen or c not in self.computations:
                continue
            seen.add(c)
            for ins in self.computations[c]:
                todo += ins.callees
        return seen

    def trip_count(self, loop: Instruction) -> int | None:
        """A while loop's trip count when its condition compares the counter with a constant (lax.scan /
        fori_loop with static bounds), else None."""
        cond = self.computations.get(loop.attr("condition") or "", [])
        consts = {i.name: int(m.group(1)) for i in cond
                  if i.op == "constant" and (m := re.search(r"constant\((-?\d+)\)", i.line))}
        for ins in cond:
            if ins.op == "compare" and "direction=LT" in ins.line:
                for name in re.findall(r"%([\w.\-]+)", ins.line.split("compare(", 1)[1].split(")")[0]):
                    if name in consts:
                        return consts[name]
        return None

    def collectives(self, root: str, multiplier: int = 1) -> list[dict]:
        """Every collective `root` runs, with nested while loops' bodies counted `trip_count` times (1 when the
        count is unknown, flagged): [{"op", "name", "computation", "bytes" (result), "operand_bytes",
        "group", "times", "shapes"}]."""
        out = []
        types = {i.name: i.type for i in self.computations.get(root, [])}
        for ins in self.computations.get(root, []):
            base = ins.op[:-len("-start")] if ins.op.endswith("-start") else ins.op
            if base in COLLECTIVES:
                out.append(_collective(ins, base, root, multiplier, types))
            elif ins.op == "while":
                trips = self.trip_count(ins)
                for part in ("body", "condition"):
                    for sub in self.collectives(ins.attr(part), multiplier * (trips or 1)):
                        sub["unknown_trips"] = sub.get("unknown_trips", False) or trips is None
                        out.append(sub)
            else:
                for callee in ins.callees:
                    out += self.collectives(callee, multiplier)
        return out


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {k.strip("'"): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
        return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return 1


def _collective(ins: Instruction, base: str, computation: str, times: int, types: dict | None = None) -> dict:
    sizes = array_bytes(ins.type)
    shapes = array_shapes(ins.type)
    result = max(sizes) if sizes else 0  # async starts print (operand, result) tuples: the larger one
    group = _group_size(ins.line)
    operand = {"all-gather": result // max(group, 1), "reduce-scatter": result * group}.get(base, result)
    if base == "ragged-all-to-all":  # one of the rows sent (operand) and the buffer received into (result) is the
        ops = _operands(ins)  # device's own rows, the other sized for the worst case (every device's rows to one):
        sent = sum(array_bytes((types or {}).get(ops[0], ""))) if ops else 0  # the smaller is the mean per device
        operand = min(sent, result) if sent else result
    return {"op": base, "name": ins.name, "computation": computation, "bytes": result, "operand_bytes": operand,
            "group": group, "times": times, "shapes": shapes}


def collective_totals(text: str) -> dict[str, dict]:
    """{op: {"count", "bytes", "operand_bytes", "unknown_trips"}} of every collective a compiled program's text
    runs from its entry, loop bodies counted their trip counts (`Module.collectives`): how many run, their result
    bytes and their operand bytes (per device) summed. For a ragged-all-to-all, whose sizes are data-dependent,
    "operand_bytes" is the smaller of its operand and its result: the exchange's rows are each device's own (the
    dispatch sends a device's token-slots, the return receives them), the other buffer is sized for the worst
    case, so it is the bytes a device sends and receives on average over the devices (a balanced router: each)."""
    module = Module(text)
    out: dict[str, dict] = {}
    for c in module.collectives(module.entry):
        t = out.setdefault(c["op"], {"count": 0, "bytes": 0, "operand_bytes": 0, "unknown_trips": False})
        t["count"] += c["times"]
        t["bytes"] += c["bytes"] * c["times"]
        t["operand_bytes"] += c["operand_bytes"] * c["times"]
        t["unknown_trips"] |= bool(c.get("unknown_trips"))
    return out


def decode_loop(module: Module) -> Instruction:
    """The outermost while loop of the entry computation with the most computations under it (the generation
    engine's decode loop: its body holds the layer scans and attention)."""
    loops = module.whiles()
    if not loops:
        raise ValueError("the entry computation has no while loop")
    return max(loops, key=lambda w: len(module.reachable(w.attr("body"))))


# ------------------------------------------------------------------------------------ loops in a cost analysis
# instructions that move no data of their own (views, tuples, constants, the loop's own plumbing)
_NO_TRAFFIC = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while", "after-all",
               "opt-barrier", "partition-id", "replica-id")


def _operands(ins: Instruction) -> list[str]:
    inside = ins.line.split(f" {ins.op}(", 1)[1] if f" {ins.op}(" in ins.line else ""
    depth, args = 1, []
    for i, ch in enumerate(inside):  # up to the parenthesis that closes the operand list
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            args = re.findall(r"%([\w.\-]+)", inside[:i])
            break
    return args


def dot_flops(ins: Instruction, types: dict[str, str]) -> int:
    """2 x output elements x contracted size of a `dot` or `convolution` (a dot_general XLA:TPU prints as a
    convolution: the lhs feature dimension `f` of its dim_labels, times the window); 0 for other ops. `types`: the
    computation's instruction name -> printed type, for the lhs operand's shape."""
    if ins.op not in ("dot", "convolution"):
        return 0
    out = array_shapes(ins.type)
    ops = _operands(ins)
    lhs = array_shapes(types.get(ops[0], "")) if ops else []
    if not out or not lhs:
        return 0
    lhs = lhs[0]
    if ins.op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
    else:
        m = re.search(r"dim_labels=(\w+)_", ins.line)
        k = lhs[m.group(1).index("f")] if m and "f" in m.group(1) and m.group(1).index("f") < len(lhs) else 1
        w = re.search(r"window=\{size=([\dx]+)", ins.line)
        k *= math.prod(int(v) for v in w.group(1).split("x")) if w else 1
    return 2 * math.prod(out[0]) * k


def _once(module: Module, comp: str, seen: set) -> tuple[int, int]:
    """(dot flops, bytes) of one run of `comp` as XLA's cost analysis counts a loop body: every callee once
    (nested loops' bodies too); bytes: the result and operands of each instruction that moves data, at the
    computation's own level (what a fusion reads and writes, not its inside)."""
    instrs = module.computations.get(comp, [])
    types = {i.name: i.type for i in instrs}
    flops = nbytes = 0
    for ins in instrs:
        flops += dot_flops(ins, types)
        if ins.op not in _NO_TRAFFIC:
            nbytes += sum(array_bytes(ins.type)) + sum(sum(array_bytes(types.get(o, ""))) for o in _operands(ins))
        for callee in ins.callees:
            if callee in seen:
                continue
            seen.add(callee)
            f, _ = _once(module, callee, seen)  # a fusion's inside: its dots; its traffic is the fusion's own
            flops += f
            if ins.op in ("while", "call", "conditional"):
                nbytes += _once(module, callee, set(seen))[1]
    return flops, nbytes


def loop_extra_cost(text: str) -> dict:
    """What XLA's cost analysis leaves out of a compiled program (`compiled.as_text()`): it counts a while loop's
    body once, so a lax.map / scan of n steps is short by n - 1 bodies. Returns {"flops", "bytes", "loops"}: the
    dot flops and the data traffic (`_once`: results and operands of the body's instructions, an approximation of
    its memory traffic) of the missing iterations of every loop with a known trip count (`Module.trip_count`;
    nested loops multiply), and [(loop, trips)]; a loop whose count is unknown is listed with trips None and
    adds nothing."""
    module = Module(text)
    out = {"flops": 0, "bytes": 0, "loops": []}

    def walk(comp: str, mult: int, seen: set):
        for ins in module.computations.get(comp, []):
            if ins.op == "while":
                trips = module.trip_count(ins)
                body = ins.attr("body")
                out["loops"].append((ins.name, trips))
                if trips and body:
                    f, b = _once(module, body, set())
                    out["flops"] += mult * (trips - 1) * f
                    out["bytes"] += mult * (trips - 1) * b
                if body:
                    walk(body, mult * (trips or 1), seen)
            elif ins.op in ("call", "conditional"):
                for callee in ins.callees:
                    if callee not in seen:
                        seen.add(callee)
                        walk(callee, mult, seen)

    walk(module.entry, 1, set())
    return out


# ------------------------------------------------------------------------------------ GPU kernels of an XLA dump
# what XLA writes with the compile option xla_dump_to (or XLA_FLAGS=--xla_dump_to=DIR) when it compiles for a GPU:
# one .ptx file per LLVM module (a Triton kernel's is its own), and the thunk sequence: each kernel's launch
_THUNK = re.compile(r"\]\s+(\S+)\s+grid:\s*\[([^\]]*)\]\s+threads:\s*\[([^\]]*)\]\s+shared_memory:\s*(\d+)\s*bytes")
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")
# tensor-core instructions: mma.sync (sm_80 on), wgmma.mma_async (sm_90a), tcgen05.mma (sm_100a)
_TENSOR_CORE = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.]*)", re.M)
_LOCAL = re.compile(r"\.local\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.replace(",", " ").split()]


def gpu_kernels(dump_dir: str) -> dict[str, dict]:
    """{kernel name: facts} of the GPU kernels in an XLA dump directory: "target" (the PTX `.target`, e.g.
    "sm_90a"), "tensor_core" {instruction: count} (mma.sync / wgmma.mma_async / tcgen05.mma in its PTX),
    "local_bytes" (PTX local memory, a stack array), "ptx" (the file), and from the thunk sequence "grid",
    "threads", "shared_memory" (bytes). ValueError when the directory holds no PTX (not a GPU compile's dump)."""
    out: dict[str, dict] = {}
    names = sorted(os.listdir(dump_dir))
    for name in names:
        if not name.endswith(".ptx"):
            continue
        path = os.path.join(dump_dir, name)
        with open(path) as f:
            text = f.read()
        target = re.search(r"^\.target\s+(\w+)", text, re.M)
        parts = _ENTRY.split(text)  # [preamble, name1, body1, name2, body2, ...]
        for entry, body in zip(parts[1::2], parts[2::2]):
            counts: dict[str, int] = {}
            for ins in _TENSOR_CORE.findall(body):
                counts[ins] = counts.get(ins, 0) + 1
            out[entry] = {"target": target.group(1) if target else None, "tensor_core": counts,
                          "local_bytes": sum(int(v) for v in _LOCAL.findall(body)), "ptx": path}
    if not any(n.endswith(".ptx") for n in names):
        raise ValueError(f"{dump_dir}: no .ptx file (not the dump of a GPU compile)")
    for name in names:
        if name.endswith("thunk_sequence.txt"):
            with open(os.path.join(dump_dir, name)) as f:
                for m in _THUNK.finditer(f.read()):
                    facts = out.setdefault(m.group(1), {})
                    facts.update(grid=_ints(m.group(2)), threads=_ints(m.group(3)), shared_memory=int(m.group(4)))
    return out


def ptxas_info(ptx: str, target: str, entry: str | None = None) -> dict | None:
    """{"registers", "spill_stores", "spill_loads", "stack"} (bytes but registers) of a PTX file's kernel `entry`
    (the first when None) as NVIDIA's ptxas (on PATH) assembles it for `target` ("sm_90a"), with "ptxas" its
    version line; None when there is no ptxas here (optional: this only reads what a kernel needs)."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    p = subprocess.run([exe, f"-arch={target}", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                       timeout=120)
    if p.returncode:
        raise ValueError(f"ptxas {ptx}: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
    version = [ln for ln in subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.splitlines()
               if "release" in ln]
    blocks = re.split(r"Compiling entry function '([\w$]+)'", p.stderr + p.stdout)
    for name, body in zip(blocks[1::2], blocks[2::2]):
        if entry is None or name == entry:
            regs = re.search(r"Used (\d+) registers", body)
            spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body)
            return {"registers": int(regs.group(1)) if regs else None,
                    "stack": int(spill.group(1)) if spill else None,
                    "spill_stores": int(spill.group(2)) if spill else None,
                    "spill_loads": int(spill.group(3)) if spill else None,
                    "ptxas": version[0].strip() if version else exe}
    raise ValueError(f"ptxas {ptx}: no kernel {entry!r} in its report")
