"""Source-patcher configs for SGLang's dumper, and a check that they still fit the code they patch.

The recipe framework (radixark/miles) drives SGLang's dumper in the engine and in the Megatron trainer;
extra dump points come from a YAML "source patcher" config (`--dumper-source-patcher-config-train`,
`--dumper-source-patcher-config-inference`):

    patches:
      - target: pkg.module.Class.method
        preamble: optional code put at the top of the body
        edits:
          - match: one or more source lines
            append: code put after them        # or prepend: / replacement:

The patcher (sglang `srt/debug_utils/source_patcher`) takes `inspect.getsource(target)`, applies the
edits in order (each `match` compared line by line with surrounding whitespace stripped, found exactly
once in the function as the earlier edits left it; inserted code re-indented to the first matched
line), dedents, adds `from sglang.srt.debug_utils.dumper import dumper` at the top of the body,
compiles the function again in its module's globals and swaps its `__code__`. A config written against
one version of a framework fails at start-up (or, worse, patches nothing useful) on another, so
`check_against_source` replays exactly that on the code a user has:

    python -m glmkit.parity.patcher_config megatron          # the shipped configs, by side
    python -m glmkit.parity.patcher_config my.yaml --source-root /path/to/checkout

prints OK or each problem (exit status 0 / 1). glmkit ships a config per side for glm5_next
(`config_path("megatron" | "sglang")`); DUMPS.md says what they dump and how to run them.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

SIDES = ("megatron", "sglang", "sglang-0.5.23")  # the engine: a newer SGLang (communicator_mhc), or the 0.5.23 release
MODES = ("append", "prepend", "replacement")
INJECTED = "dumper"  # `from sglang.srt.debug_utils.dumper import dumper`, added by the dumper to every patch
_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "dumper"


class PatcherConfigError(ValueError):
    """A config that the patcher would refuse or misapply, named by file, patch and edit index."""


@dataclass(frozen=True)
class Edit:
    match: str
    mode: str | None  # "append" / "prepend" / "replacement"
    code: str


@dataclass(frozen=True)
class Patch:
    target: str
    edits: tuple
    preamble: str = ""


@dataclass(frozen=True)
class PatcherConfig:
    patches: tuple
    path: str = "<config>"


@dataclass(frozen=True)
class DumpCall:
    name: str
    dims: str | None
    patch: int
    edit: int | None  # None: the preamble
    target: str


def config_path(side: str) -> Path:
    """The config glmkit ships for one side of the framework: "megatron" (trainer), "sglang" (engine, SGLang
    with layers/communicator_mhc.py) or "sglang-0.5.23" (engine, the 0.5.23 release)."""
    if side not in SIDES:
        raise ValueError(f"side {side!r}: expected one of {', '.join(SIDES)}")
    return _ASSETS / f"glm5_next_{side.replace('-', '_')}.yaml"


# --- loading ----------------------------------------------------------------------------------------------

def load_patcher_config(path) -> PatcherConfig:
    """Read and check a patcher YAML (the schema of sglang's source patcher). Raises PatcherConfigError."""
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - transformers brings pyyaml
        raise PatcherConfigError("reading a patcher config needs pyyaml (pip install pyyaml)") from err
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise PatcherConfigError(f"{path}: cannot read ({err.strerror or err})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PatcherConfigError(f"{path}: not valid YAML ({err})") from None
    return parse_patcher_config(raw, str(path))


def parse_patcher_config(raw, where: str = "<config>") -> PatcherConfig:
    """The checked form of an already-loaded config (a dict with a `patches` list)."""
    if not isinstance(raw, dict):
        raise PatcherConfigError(f"{where}: expected a mapping with a 'patches' list, got {type(raw).__name__}")
    extra = set(raw) - {"patches"}
    if extra:
        raise PatcherConfigError(f"{where}: unknown top-level key(s) {sorted(extra)}; only 'patches'")
    patches = raw.get("patches")
    if not isinstance(patches, list) or not patches:
        raise PatcherConfigError(f"{where}: 'patches' must be a non-empty list")
    out = []
    for i, patch in enumerate(patches):
        at = f"{where}: patch {i}"
        if not isinstance(patch, dict):
            raise PatcherConfigError(f"{at}: expected a mapping, got {type(patch).__name__}")
        unknown = set(patch) - {"target", "edits", "preamble"}
        if unknown:
            raise PatcherConfigError(f"{at}: unknown key(s) {sorted(unknown)}; allowed: target, edits, preamble")
        target = patch.get("target")
        if not isinstance(target, str) or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", target.strip()):
            raise PatcherConfigError(f"{at}: 'target' must be a dotted name like pkg.module.Class.method, "
                                     f"got {target!r}")
        at = f"{where}: patch {i} ({target.strip()})"
        preamble = patch.get("preamble") or ""
        if not isinstance(preamble, str):
            raise PatcherConfigError(f"{at}: 'preamble' must be a string")
        edits = patch.get("edits")
        if not isinstance(edits, list) or not edits:
            raise PatcherConfigError(f"{at}: 'edits' must be a non-empty list")
        checked = []
        for j, edit in enumerate(edits):
            eat = f"{at} edit {j}"
            if not isinstance(edit, dict):
                raise PatcherConfigError(f"{eat}: expected a mapping, got {type(edit).__name__}")
            unknown = set(edit) - {"match", *MODES}
            if unknown:
                raise PatcherConfigError(f"{eat}: unknown key(s) {sorted(unknown)}; allowed: match, "
                                         f"{', '.join(MODES)}")
            match = edit.get("match")
            if not isinstance(match, str) or not match.strip():
                raise PatcherConfigError(f"{eat}: 'match' must be a non-empty string")
            given = [m for m in MODES if m in edit]
            for m in given:
                if not isinstance(edit[m], str):
                    raise PatcherConfigError(f"{eat}: '{m}' must be a string")
            # the patcher takes the first non-blank of prepend, append, replacement and ignores the others;
            # an edit with none deletes the matched lines - never what a dump config means
            if len(given) > 1:
                raise PatcherConfigError(f"{eat}: give one of {', '.join(MODES)}, not {', '.join(given)}")
            if not given:
                raise PatcherConfigError(f"{eat}: no append/prepend/replacement: the patcher would delete the "
                                         f"matched lines")
            mode = given[0]
            if mode != "replacement" and not edit[mode].strip():
                raise PatcherConfigError(f"{eat}: '{mode}' is empty")
            checked.append(Edit(match, mode, edit[mode]))
        out.append(Patch(target.strip(), tuple(checked), preamble))
    return PatcherConfig(tuple(out), where)


def _as_config(config) -> PatcherConfig:
    return config if isinstance(config, PatcherConfig) else load_patcher_config(config)


# --- what a config dumps ----------------------------------------------------------------------------------

def _snippets(config: PatcherConfig):
    for i, patch in enumerate(config.patches):
        if patch.preamble.strip():
            yield i, None, patch.target, patch.preamble
        for j, edit in enumerate(patch.edits):
            if edit.code.strip():
                yield i, j, patch.target, edit.code


def _is_dump(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dump"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == INJECTED)


def dump_calls(config) -> list[DumpCall]:
    """Every `dumper.dump("NAME", value, dims="...")` a config inserts, in config order."""
    config = _as_config(config)
    calls = []
    for i, j, target, code in _snippets(config):
        try:
            tree = ast.parse(textwrap.dedent(code))
        except SyntaxError:  # a replacement may be a fragment: fall back to the text
            for m in re.finditer(r"\bdumper\.dump\(\s*(['\"])(.+?)\1", code):
                dims = re.search(r"\bdims\s*=\s*(['\"])(.*?)\1", code[m.end():].split("dumper.dump(")[0])
                calls.append(DumpCall(m.group(2), dims.group(2) if dims else None, i, j, target))
            continue
        nodes = sorted((n for n in ast.walk(tree) if _is_dump(n)), key=lambda n: (n.lineno, n.col_offset))
        for node in nodes:
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                raise PatcherConfigError(f"{config.path}: patch {i} ({target}) "
                                         f"{'preamble' if j is None else f'edit {j}'}: dumper.dump's name must be "
                                         f"a string literal")
            dims = next((k.value for k in node.keywords if k.arg == "dims"), None)
            dims = dims.value if isinstance(dims, ast.Constant) and isinstance(dims.value, str) else None
            calls.append(DumpCall(first.value, dims, i, j, target))
    return calls


def dump_names(config) -> list[str]:
    """The names a config dumps (each once, in config order)."""
    return list(dict.fromkeys(c.name for c in dump_calls(config)))


def check_dims(config) -> list[str]:
    """Problems with the `dims` of each dump: missing, unreadable by glmkit's reader, or with no token dim."""
    from glmkit.parity.framework_dump import parse_dims

    config = _as_config(config)
    problems = []
    for c in dump_calls(config):
        at = f"patch {c.patch} ({c.target}) {'preamble' if c.edit is None else f'edit {c.edit}'}: {c.name!r}"
        if not c.dims:
            problems.append(f"{at}: no dims=\"...\" literal (the reader needs it to join ranks and find the token dim)")
            continue
        try:
            dims, _, _ = parse_dims(c.dims)
        except ValueError as err:
            problems.append(f"{at}: dims {c.dims!r} do not parse ({err})")
            continue
        if "t" not in [d.name for d in dims]:
            problems.append(f"{at}: dims {c.dims!r} name no token dim 't'")
    return problems


# --- replaying the patcher --------------------------------------------------------------------------------

class _Refused(Exception):
    pass


def _find(lines: list[str], match: str) -> int:
    want = [line.strip() for line in match.strip().splitlines()]
    have = [line.strip() for line in lines]
    hits = [i for i in range(len(have) - len(want) + 1) if have[i:i + len(want)] == want]
    shown = want[0] if len(want) == 1 else f"{want[0]} ... ({len(want)} lines)"
    if not hits:
        first = sum(line == want[0] for line in have)
        hint = (f"; its first line occurs {first} time(s) but not followed by the rest" if first and len(want) > 1
                else "")
        raise _Refused(f"match not found: {shown!r}{hint}")
    if len(hits) > 1:
        raise _Refused(f"match found {len(hits)} times (must be unique in the function): {shown!r}")
    return hits[0]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _realign(code_lines: list[str], indent: int) -> list[str]:
    body = [line for line in code_lines if line.strip()]
    if not body:
        return []
    base = _indent(body[0])
    return ["" if not line.strip() else " " * indent + line[min(base, _indent(line)):] for line in code_lines]


def apply_edits(source: str, edits) -> str:
    """The function's source after the edits, as sglang's source patcher makes it (raises _Refused)."""
    for edit in edits:
        lines = source.splitlines()
        match = edit.match.strip()
        at = _find(lines, match)
        n = len(match.splitlines())
        if edit.mode == "prepend":
            new = edit.code.strip() + "\n" + match
        elif edit.mode == "append":
            new = match + "\n" + edit.code.strip()
        else:
            new = edit.code.strip()
        replaced = _realign(new.splitlines() if new else [], _indent(lines[at]))
        source = "\n".join(lines[:at] + replaced + lines[at + n:]) + ("\n" if source.endswith("\n") else "")
    return source


def _with_preamble(source: str, preamble: str) -> str:
    lines = source.splitlines()
    end = next((i for i, line in enumerate(lines) if line.rstrip().endswith(":")), 0)
    start, indent = end + 1, ""
    for i in range(end + 1, len(lines)):
        if lines[i].strip():
            start, indent = i, " " * _indent(lines[i])
            break
    return "\n".join(lines[:start] + [indent + p for p in preamble.strip().splitlines()] + lines[start:])


def _module_names(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        else:
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def _unbound_names(function_source: str, inserted: list[str], known: set) -> list[str]:
    """Names the inserted code reads that the patched function does not bind and its module does not have."""
    tree = ast.parse(function_source)
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.posonlyargs + n.args + n.kwonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
    bound |= {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    used = set()
    for code in inserted:
        try:
            snippet = ast.parse(textwrap.dedent(code))
        except SyntaxError:
            continue
        used |= {n.id for n in ast.walk(snippet) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - bound - known - set(dir(builtins)) - {INJECTED})


@dataclass
class _Source:
    text: str                 # the function as inspect.getsource gives it (decorators included)
    module_names: set | None  # the module's global names, when known
    decorated: bool
    closure: bool             # free variables (a zero-argument super(), a nested function)
    where: str


def _from_file(path: Path, attrs: list[str], target: str) -> _Source:
    text = path.read_text()
    tree = ast.parse(text)
    scope, node = tree.body, None
    for k, name in enumerate(attrs):
        found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name]
        if not found:
            raise _Refused(f"{'.'.join(attrs[:k + 1])} is not defined in {path}")
        node = found[-1]  # a later definition wins, as at import time
        scope = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _Refused(f"{target} is a class, not a function")
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.splitlines(keepends=True)[first - 1:node.end_lineno]
    uses_class_cell = bool(re.search(r"\bsuper\(\s*\)|\b__class__\b", ast.unparse(node)))
    return _Source("".join(lines), _module_names(tree), bool(node.decorator_list), uses_class_cell,
                   f"{path}:{first}")


def _resolve_in_roots(roots: list, target: str) -> _Source:
    parts = target.split(".")
    for k in range(len(parts) - 1, 0, -1):
        for root in roots:
            base = root.joinpath(*parts[:k])
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    return _from_file(path, parts[k:], target)
    raise _Refused(f"no module file for any prefix of {target} under {', '.join(map(str, roots))}")


def _resolve_imported(target: str) -> _Source:
    parts = target.split(".")
    obj, err = None, None
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError as e:
            err = err or e
            continue
        for name in parts[k:]:
            try:
                obj = getattr(obj, name)
            except AttributeError:
                raise _Refused(f"{'.'.join(parts[:k])} has no attribute path {'.'.join(parts[k:])}") from None
        break
    else:
        raise _Refused(f"cannot import any module prefix of {target} ({type(err).__name__}: {err})")
    if isinstance(obj, classmethod):
        obj = obj.__func__
    if not callable(obj) or not hasattr(obj, "__code__"):
        raise _Refused(f"{target} resolves to {type(obj).__name__}, not a plain function")
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise _Refused(f"no source for {target} ({e})") from None
    wrapped = inspect.unwrap(obj) is not obj
    module = sys.modules.get(obj.__module__)
    return _Source(text, set(vars(module)) if module else set(obj.__globals__), wrapped or text.lstrip().startswith("@"),
                   bool(obj.__code__.co_freevars), f"{inspect.getsourcefile(obj)}:{obj.__code__.co_firstlineno}")


def check_against_source(config, import_root=None, *, sources: Mapping[str, str] | None = None) -> list[str]:
    """Replay the patcher on each target's real source; [] when every patch would apply and compile.

    The source of a target comes from `sources` (target -> the function's text, as inspect.getsource
    gives it), else from the module file under `import_root` (a folder laid out as the packages are,
    e.g. a checkout's `python/` for sglang or its root for Megatron-LM, or a list of such folders,
    searched in order; nothing is imported), else from importing it. Checked per target: it resolves to a plain function; each `match` occurs exactly once
    among the stripped lines of the function as the earlier edits left it; the patched function compiles;
    the inserted code reads no name the function and its module lack; the patcher can swap the code in
    (no decorator, no zero-argument super() / closure)."""
    config = _as_config(config)
    roots = None
    if import_root is not None:
        roots = [Path(r) for r in ([import_root] if isinstance(import_root, (str, Path)) else import_root)]
    problems = []
    for i, patch in enumerate(config.patches):
        at = f"patch {i} ({patch.target})"
        try:
            if sources is not None and patch.target in sources:
                text = sources[patch.target]
                src = _Source(text, None, text.lstrip().startswith("@"), bool(re.search(r"\bsuper\(\s*\)", text)),
                              "<given>")
            elif roots is not None:
                src = _resolve_in_roots(roots, patch.target)
            else:
                src = _resolve_imported(patch.target)
        except _Refused as err:
            problems.append(f"{at}: {err}")
            continue
        except (OSError, SyntaxError) as err:
            problems.append(f"{at}: cannot read its source ({type(err).__name__}: {err})")
            continue
        source = src.text
        failed = False
        for j, edit in enumerate(patch.edits):
            try:
                source = apply_edits(source, [edit])
            except _Refused as err:
                problems.append(f"{at} edit {j}: {err}")
                failed = True
        if failed:
            continue
        preamble = "\n".join(p for p in (f"from sglang.srt.debug_utils.dumper import {INJECTED}", patch.preamble)
                             if p.strip())
        patched = _with_preamble(textwrap.dedent(source), preamble)
        try:
            compile(patched, src.where, "exec", dont_inherit=True)
        except SyntaxError as err:
            line = patched.splitlines()[err.lineno - 1].strip() if err.lineno else ""
            problems.append(f"{at}: the patched function does not compile ({err.msg}, at {line!r})")
            continue
        if src.decorated:
            problems.append(f"{at}: the function is decorated; the patcher recompiles it with its decorators and "
                            f"swaps the wrapper's code, not the function's")
        if src.closure:
            problems.append(f"{at}: the function has free variables (zero-argument super() or a closure); the "
                            f"patcher recompiles it outside its class and cannot swap its code")
        inserted = [e.code for e in patch.edits] + [patch.preamble]
        known = src.module_names if src.module_names is not None else None
        if known is not None:
            missing = _unbound_names(textwrap.dedent(source), inserted, known)
            if missing:
                problems.append(f"{at}: the inserted code reads {', '.join(missing)}, which neither the function "
                                f"nor its module defines")
    return problems


# --- command line -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glmkit.parity.patcher_config",
        description="Check a dumper source-patcher config against the installed (or given) framework code.")
    parser.add_argument("config", help="a patcher YAML, or 'megatron' / 'sglang' for the config glmkit ships")
    parser.add_argument("--source-root", action="append", metavar="DIR",
                        help="read targets from module files under this folder instead of importing them "
                             "(repeatable, searched in order)")
    args = parser.parse_args(argv)
    path = config_path(args.config) if args.config in SIDES else Path(args.config)
    try:
        config = load_patcher_config(path)
        problems = check_dims(config) + check_against_source(config, args.source_root)
    except PatcherConfigError as err:
        print(f"error: {err}")
        return 1
    if problems:
        print(f"{path}: {len(problems)} problem(s)")
        for p in problems:
            print(f"  - {p}")
        return 1
    names = dump_names(config)
    print(f"OK {path}: {len(config.patches)} patches, {sum(len(p.edits) for p in config.patches)} edits, "
          f"{len(names)} names: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
