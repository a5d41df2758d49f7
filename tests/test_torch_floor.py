"""Nothing on the CUDA path calls a torch API that torch 2.11 lacks (issue 43).

A lent GPU runs its own torch, 2.11 (CUDA 13), not the pinned 2.13 (Makefile TORCH_SPEC);
there is no registry there to install another. This test reads the code that runs there
(tandem/, services/, the bench scripts `make gpu-check` calls and the tests it runs on
CUDA) without importing it, resolves every reference to torch through the file's imports
(`import torch.nn.functional as F` makes `F.silu` torch.nn.functional.silu), and fails
naming each one that NEWER_THAN_2_11 lists:

    name    torch.a.b      a module attribute 2.11 does not have (also matched through a
                           re-export: torch.cuda.x finds torch.cuda.memory.x)
    module  torch.a        a module 2.11 does not have
    param   leaf(p)        keyword p that 2.11's function or class `leaf` does not take,
                           matched against the keywords of a call to a torch `leaf`
    name    torch.Tensor.m a Tensor method 2.11 lacks, matched at any `.m(...)` call

A reference through a private module (torch._x) is checked only where the list covers
that module (COVERED_PRIVATE); any other fails as not covered, so a new private import
never passes unseen. A newer API kept behind a run-time test (vit/runner.py's `num_splits`,
passed only where `inspect.signature` shows it) is not a call this scan sees: that is the
fallback the issue allows, chosen at run time.

The list is derived, not typed: `python tests/test_torch_floor.py derive OLD NEW` compares
two torch trees' Python sources and stubs (.py and .pyi: definitions, re-exports from
torch, function parameters, the ATen ops of torch._C._VariableFunctions.pyi and the Tensor
methods of torch._C.TensorBase) and prints the list. It was made from torch 2.11.0 (PyPI's
macOS arm64 wheel: the same Python files as the Linux build, 80 MB) and 2.13.0 (the
project's pin), each unzipped with `unzip WHEEL 'torch/*.py' 'torch/*.pyi'`. What the
static view cannot see (an attribute set at run time, a C function's keyword without a
stub) is not in it: the GPU run itself is the last word.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What runs on the lent GPU: the package, the tiers, the bench scripts `make gpu-check`
# calls on CUDA, and the test files it runs there (tests/* marked gpu, the exactness suites).
SCANNED_DIRS = ("tandem", "services")
SCANNED_FILES = (
    "bench/gpu_check.py", "bench/paged_attention.py", "bench/vit_graphs.py", "bench/language.py",
    "tests/conftest.py", "tests/language_oracle.py", "tests/test_language_model.py",
    "tests/test_language_engine.py", "tests/test_bf16.py", "tests/test_graph_runner.py",
    "tests/test_paged_attention.py", "tests/test_encoder_units.py", "tests/test_vit_graphs.py",
    "tests/test_language_startup.py", "tests/test_upload_staging.py",
    "tests/test_video_payload.py",
)
# The modules whose private names the list holds too (torch: its private ATen ops, such as
# torch._local_scalar_dense), and the private modules the code uses (their own names, not
# their submodules').
COVERED_PRIVATE = (
    "torch", "torch._dynamo", "torch._dynamo.config", "torch._ops", "torch._subclasses",
    "torch._subclasses.fake_tensor", "torch.utils._python_dispatch", "torch.utils._pytree",
)


@dataclass(frozen=True)
class Finding:
    where: str  # path:line
    ref: str  # the torch name, or leaf(keyword)
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.ref} ({self.why})"


@dataclass(frozen=True)
class Floor:
    """NEWER_THAN_2_11, parsed."""

    names: frozenset[str]  # qualified: torch.a.b, torch.Tensor.m
    modules: frozenset[str]
    params: frozenset[tuple[str, str]]  # (function or class leaf name, keyword)

    @classmethod
    def parse(cls, text: str) -> Floor:
        names, modules, params = set(), set(), set()
        for line in text.split("\n"):
            if not line.strip():
                continue
            kind, what = line.split()
            if kind == "name":
                names.add(what)
            elif kind == "module":
                modules.add(what)
            elif kind == "param":
                leaf, p = what.rstrip(")").split("(")
                params.add((leaf, p))
            else:
                raise ValueError(f"NEWER_THAN_2_11: unknown kind {kind!r}")
        return cls(frozenset(names), frozenset(modules), frozenset(params))

    def __post_init__(self):
        by_leaf: dict[str, list[str]] = {}
        for n in self.names:
            by_leaf.setdefault(n.rsplit(".", 1)[1], []).append(n)
        object.__setattr__(self, "_by_leaf", by_leaf)
        methods = {n.rsplit(".", 1)[1] for n in self.names if n.startswith("torch.Tensor.")}
        object.__setattr__(self, "tensor_methods", frozenset(methods))

    def newer(self, ref: str) -> str | None:
        """Why `ref` (torch.a.b.c) is newer than 2.11, or None."""
        parts = ref.split(".")
        for i in range(2, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in self.modules:
                return f"module {prefix} is not in torch 2.11"
            if prefix in self.names:
                return "not in torch 2.11"
            # a re-export from a submodule: torch.cuda.x is torch.cuda.memory.x
            parent, leaf = ".".join(parts[: i - 1]), parts[i - 1]
            for n in [] if leaf.startswith("__") else self._by_leaf.get(leaf, ()):
                middle = n[len(parent) + 1 : -len(leaf) - 1]
                if n.startswith(parent + ".") and middle.isidentifier() and middle.islower():
                    return f"not in torch 2.11 (as {n})"
        return None


def private_uncovered(ref: str) -> bool:
    """`ref` passes through a private name (torch._x, torch.cuda._y) the list cannot vouch
    for. It holds the names of the COVERED_PRIVATE modules, private ones too, and their
    classes' members: a private part is vouched for inside the longest covered module
    `ref` lies in, or as its leaf, and only for refs at most two names below that module."""
    parts = ref.split(".")
    if not any(p.startswith("_") and not p.startswith("__") for p in parts):
        return False
    covered = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in COVERED_PRIVATE),
                  default=0)
    return len(parts) - covered > 2 or any(
        p.startswith("_") and not p.startswith("__") and not (i < covered or i == covered == len(parts) - 1)
        for i, p in enumerate(parts))


def torch_refs(tree: ast.Module) -> list[tuple[int, str, ast.AST]]:
    """(line, qualified torch name, node) of every import from torch, attribute chain rooted
    at a name bound to torch (through `import torch...` or `from torch... import`), and call
    of a from-imported name."""
    alias: dict[str, str] = {}
    refs: list[tuple[int, str, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
                    refs.append((node.lineno, a.name, node))
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and (node.module == "torch" or node.module.startswith("torch."))):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                refs.append((node.lineno, f"{node.module}.{a.name}", node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in alias:
            refs.append((node.lineno, alias[node.func.id], node.func))  # a from-imported callable
        elif isinstance(node, ast.Attribute):
            chain, n = [], node
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id in alias:
                refs.append((node.lineno, ".".join([alias[n.id], *reversed(chain)]), node))
    return refs


def scan_file(path: Path, floor: Floor) -> list[Finding]:
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix()
    out: list[Finding] = []
    refs = torch_refs(tree)
    called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for line, ref, node in refs:
        if ref.startswith("torch.ops."):  # the op registry: ATen ops are torch's functions
            if not ref.startswith("torch.ops.aten."):
                continue  # this project's own ops (torch.ops.tandem...)
            ref = "torch." + ref.split(".")[3]
        if private_uncovered(ref):
            out.append(Finding(f"{rel}:{line}", ref, "a private torch module the list does "
                               "not cover: add it to COVERED_PRIVATE and derive the list again"))
            continue
        if why := floor.newer(ref):
            out.append(Finding(f"{rel}:{line}", ref, why))
        if (call := called.get(id(node))) is not None:
            leaf = ref.rsplit(".", 1)[1]
            for kw in call.keywords:
                if kw.arg and (leaf, kw.arg) in floor.params:
                    out.append(Finding(f"{rel}:{line}", f"{ref}({kw.arg}=...)",
                                       "a keyword torch 2.11 does not take"))
    for node in ast.walk(tree):  # Tensor methods, on any receiver
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in floor.tensor_methods):
            out.append(Finding(f"{rel}:{node.lineno}", f"Tensor.{node.func.attr}",
                               "a Tensor method torch 2.11 lacks"))
    return out


def scanned_files() -> list[Path]:
    files = [p for d in SCANNED_DIRS for p in sorted((ROOT / d).rglob("*.py"))
             if "v1" not in p.relative_to(ROOT).parts]  # generated gRPC stubs
    return files + [ROOT / f for f in SCANNED_FILES]


# -- the tests ---------------------------------------------------------------------------


def test_the_cuda_path_needs_nothing_newer_than_torch_2_11():
    floor = Floor.parse(NEWER_THAN_2_11)
    findings = [f for p in scanned_files() for f in scan_file(p, floor)]
    assert not findings, "calls torch 2.11 lacks:\n" + "\n".join(map(str, findings))


def test_the_scan_names_a_planted_newer_call(tmp_path, monkeypatch):
    """Each kind of entry is found, through an alias, a from-import and a re-export."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.cuda import graph\n"
        "from torch._inductor import config\n"
        "F.linear_cross_entropy(x, w, y)\n"
        "torch.cuda.caching_allocator_disabled()\n"
        "with graph(g, check_input_liveness=True):\n"
        "    torch.ops.aten.thread_safe_generator()\n"
        "torch.cuda.synchronize()\n"  # in 2.11: not a finding
    )
    found = {(f.where.split(":")[1], f.ref) for f in scan_file(planted, Floor.parse(NEWER_THAN_2_11))}
    assert found == {
        ("4", "torch._inductor.config"),
        ("5", "torch.nn.functional.linear_cross_entropy"),
        ("6", "torch.cuda.caching_allocator_disabled"),
        ("7", "torch.cuda.graph(check_input_liveness=...)"),
        ("8", "torch.thread_safe_generator"),
    }, found


# -- deriving the list -------------------------------------------------------------------


def _module_files(root: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for p in sorted(root.rglob("*.py*")):
        if p.suffix in (".py", ".pyi"):
            parts = p.relative_to(root).with_suffix("").parts
            out.setdefault(".".join(parts[:-1] if parts[-1] == "__init__" else parts), []).append(p)
    return out


def _api(root: Path) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]]]:
    """Per module: its names (Class.member for classes' members) and each function's
    parameters (a class's are its __init__'s, under the class name)."""
    names: dict[str, set[str]] = {}
    sigs: dict[str, dict[str, set[str]]] = {}

    def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
        a = fn.args
        return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} - {"self", "cls"}

    def walk(body: list[ast.stmt], mod: str, prefix: str) -> None:
        for n in body:
            if isinstance(n, (ast.If, ast.Try)):
                sub = n.body + n.orelse + getattr(n, "finalbody", [])
                for h in getattr(n, "handlers", []):
                    sub += h.body
                walk(sub, mod, prefix)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[mod].add(prefix + n.name)
                leaf = prefix[:-1] if n.name == "__init__" and prefix else prefix + n.name
                sigs[mod].setdefault(leaf, set()).update(params(n))
            elif isinstance(n, ast.ClassDef):
                names[mod].add(prefix + n.name)
                if not prefix:
                    walk(n.body, mod, n.name + ".")
            elif isinstance(n, ast.Assign | ast.AnnAssign):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    names[mod].update(prefix + e.id for e in ast.walk(t) if isinstance(e, ast.Name))
            elif isinstance(n, ast.ImportFrom) and not prefix and (
                    n.level or (n.module or "").split(".")[0] == "torch"):  # re-exports only
                names[mod].update(a.asname or a.name for a in n.names if a.name != "*")

    for mod, files in _module_files(root).items():
        names[mod], sigs[mod] = set(), {}
        for f in files:
            try:
                walk(ast.parse(f.read_text(errors="replace")).body, mod, "")
            except SyntaxError:
                continue
    # torch's top level takes the ATen ops at run time (a loop over _VariableFunctions), and
    # Tensor is torch._C.TensorBase plus torch._tensor.Tensor
    vf = "torch._C._VariableFunctions"
    names["torch"] |= {n for n in names.get(vf, ()) if "." not in n}
    for k, v in sigs.get(vf, {}).items():
        sigs["torch"].setdefault(k, set()).update(v)
    names["torch"] |= {"Tensor." + n.split(".", 1)[1] for n in names.get("torch._C", ())
                       if n.startswith("TensorBase.")}
    names["torch"] |= {n for n in names.get("torch._tensor", ()) if n.startswith("Tensor.")}
    for mod in list(names):
        if "." in mod and mod.rsplit(".", 1)[0] in names:
            names[mod.rsplit(".", 1)[0]].add(mod.rsplit(".", 1)[1])
    return names, sigs


def derive(old: Path, new: Path) -> list[str]:
    """The list's lines: what `new`'s torch tree has and `old`'s lacks, public or vouched
    for by COVERED_PRIVATE (dunders aside). OLD and NEW each hold a `torch` folder."""
    old_names, old_sigs = _api(old)
    new_names, new_sigs = _api(new)

    def kept(mod: str, leaf: str = "") -> bool:
        return not private_uncovered(f"{mod}.{leaf}" if leaf else mod)

    lines = []
    for mod in sorted(new_names):
        if mod not in old_names:
            if kept(mod):
                lines.append(f"module {mod}")
            continue
        lines += [f"name {mod}.{n}" for n in sorted(new_names[mod] - old_names[mod])
                  if kept(mod, n) and not n.split(".")[-1].startswith("__")]
        for fn, ps in sorted(new_sigs[mod].items()):
            if fn in old_sigs[mod] and kept(mod, fn):
                lines += [f"param {fn.rsplit('.', 1)[-1]}({p})" for p in sorted(ps - old_sigs[mod][fn])
                          if not p.startswith("_")]
    tensor = [f"name torch.Tensor.{n.split('.', 1)[1]}" for n in
              sorted(new_names["torch"] - old_names["torch"]) if n.startswith("Tensor.")]
    return sorted(set(lines) | set(tensor))


NEWER_THAN_2_11 = """
module torch._dynamo.bytecode_debugger
module torch._dynamo.comprehension_graph_break
module torch._dynamo.polyfills.copy
module torch._dynamo.variables.hashable
module torch._dynamo.variables.invoke_subgraph
module torch._dynamo.variables.object_protocol
module torch._dynamo.variables.sets
module torch._native
module torch._tensor_iterator
module torch.accelerator.graphs
module torch.backends.python_native
module torch.distributed.elastic.utils.process_state
module torch.fx.experimental.dynamic_spec
module torch.nn.modules.linear_cross_entropy
module torch.nn.modules.linear_cross_entropy_options
module torch.utils.debug_log
name torch.ParamsSpec
name torch.ShapesSpec
name torch.Tensor._philox_normal_
name torch.Tensor._philox_uniform_
name torch._dynamo.allow_c_slot
name torch._dynamo.aot_compile.atomic_write_binary
name torch._dynamo.bytecode_debugger
name torch._dynamo.bytecode_transformation.create_breakpoint
name torch._dynamo.bytecode_transformation.get_call_callable_depth
name torch._dynamo.codegen.TorchScriptObjectVariable
name torch._dynamo.comprehension_graph_break
name torch._dynamo.config._shapes_spec
name torch._dynamo.config.automatic_dynamic_exclusion_guard
name torch._dynamo.config.debug_dynamo_config_override
name torch._dynamo.config.enable_p2p_compilation
name torch._dynamo.config.enable_trace_load_build_class
name torch._dynamo.config.generate_pycode
name torch._dynamo.config.inline_invoke_subgraph
name torch._dynamo.config.inline_single_use_invoke_subgraph
name torch._dynamo.convert_frame.CodeOptions
name torch._dynamo.convert_frame.UserError
name torch._dynamo.convert_frame.add_skip_reason
name torch._dynamo.convert_frame.clear_compile_context_weakrefs
name torch._dynamo.convert_frame.code_context
name torch._dynamo.convert_frame.compiled_code_has_side_effects
name torch._dynamo.convert_frame.get_compiled_code_side_effects
name torch._dynamo.convert_frame.get_eval_frame_isolate_recompiles_id
name torch._dynamo.convert_frame.is_traceable_wrapper_subclass
name torch._dynamo.debug_utils.UnsupportedNNModuleError
name torch._dynamo.decorators.CudagraphOverrideContextManager
name torch._dynamo.decorators.InvalidVersion
name torch._dynamo.decorators.OpaqueBase
name torch._dynamo.decorators.Version
name torch._dynamo.decorators.allow_c_slot
name torch._dynamo.decorators.allow_lru_cache_wrapper_trace_without_warning
name torch._dynamo.decorators.is_lru_cache_wrapped_function
name torch._dynamo.decorators.override_cudagraphs
name torch._dynamo.decorators.override_optimization_hint
name torch._dynamo.device_interface.TpuInterface
name torch._dynamo.device_interface.has_torch_tpu
name torch._dynamo.eval_frame.ParamsSpec
name torch._dynamo.eval_frame.ShapesSpec
name torch._dynamo.eval_frame.add_skip_reason
name torch._dynamo.eval_frame.get_eval_frame_isolate_recompiles_id
name torch._dynamo.eval_frame.get_skip_reasons
name torch._dynamo.eval_frame.reset_skip_reasons
name torch._dynamo.eval_frame.set_eval_frame_isolate_recompiles_id
name torch._dynamo.eval_frame.set_fullgraph_compiled_frame_count
name torch._dynamo.eval_frame.set_fullgraph_error_on_nested_compile
name torch._dynamo.exc.RequiresGradRestartAnalysis
name torch._dynamo.exc.VariableTracker
name torch._dynamo.exc.raise_type_error
name torch._dynamo.exc.raise_value_error
name torch._dynamo.functional_export.GetItemSource
name torch._dynamo.functional_export.OutputReturnInfo
name torch._dynamo.functional_export.detect_fake_mode
name torch._dynamo.graph_bytecode_inputs.CURRENT_STREAM_INDEX
name torch._dynamo.graph_bytecode_inputs.set_external_object_by_index
name torch._dynamo.graph_id_filter.get_dynamo_config_override_for_compile_id
name torch._dynamo.guards.FakeScriptObject
name torch._dynamo.guards.GUARD_VALUE_DISPATCH
name torch._dynamo.guards.GuardCheckSpec
name torch._dynamo.guards.MISSING_GUARD_SPECS
name torch._dynamo.guards.SKIP_GUARD
name torch._dynamo.guards.UnsupportedGuardCheckSpec
name torch._dynamo.guards.check_closure
name torch._dynamo.guards.check_dtensor_spec
name torch._dynamo.guards.check_opaque_obj
name torch._dynamo.guards.check_subclass_metadata
name torch._dynamo.guards.describe_backend
name torch._dynamo.guards.extract_closure
name torch._dynamo.guards.extract_dtensor_spec
name torch._dynamo.guards.extract_opaque_obj
name torch._dynamo.guards.extract_subclass_metadata
name torch._dynamo.guards.extract_tensor_metadata
name torch._dynamo.guards.normalize_count_iter
name torch._dynamo.guards.register_guard_check_spec
name torch._dynamo.guards.skip_guard_check_spec
name torch._dynamo.guards.unsupported_guard_check_spec
name torch._dynamo.output_graph.CodeOptions
name torch._dynamo.output_graph.DictGetItemSource
name torch._dynamo.output_graph.OutputReturnInfo
name torch._dynamo.output_graph.OutputReturnKind
name torch._dynamo.output_graph.SizesStridesInfo
name torch._dynamo.output_graph.TensorMetadataDim
name torch._dynamo.output_graph.TensorMetadataSequence
name torch._dynamo.override_cudagraphs
name torch._dynamo.override_optimization_hint
name torch._dynamo.package.CacheArtifactRecorder
name torch._dynamo.pgo.CacheArtifactRecorder
name torch._dynamo.pgo.InstructionTranslatorBase
name torch._dynamo.pgo.symbolic_shape_log
name torch._dynamo.polyfills.accumulate_grad_no_alias
name torch._dynamo.polyfills.copy
name torch._dynamo.polyfills.dictview_richcompare
name torch._dynamo.polyfills.getattr_and_trace_no_nested_graph_breaks
name torch._dynamo.replay_record.CodeOptions
name torch._dynamo.resume_execution.CodeOptions
name torch._dynamo.resume_execution.RESUME_FRAME_VALUES_VARNAME
name torch._dynamo.resume_execution.create_clear_frame_value
name torch._dynamo.resume_execution.create_load_frame_value
name torch._dynamo.side_effects.AttrMutationKind
name torch._dynamo.side_effects.AttrSource
name torch._dynamo.side_effects.OrderedSet
name torch._dynamo.side_effects.is_namedtuple_cls
name torch._dynamo.side_effects.is_structseq_class
name torch._dynamo.symbolic_convert.CO_VARARGS
name torch._dynamo.symbolic_convert.CO_VARKEYWORDS
name torch._dynamo.symbolic_convert.CodeOptions
name torch._dynamo.symbolic_convert.DictBuiltinVariable
name torch._dynamo.symbolic_convert.SourceLocation
name torch._dynamo.symbolic_convert.TensorVariable
name torch._dynamo.symbolic_convert.UserError
name torch._dynamo.symbolic_convert.format_tensor_computation_trace
name torch._dynamo.symbolic_convert.generic_bool
name torch._dynamo.symbolic_convert.generic_contains
name torch._dynamo.symbolic_convert.generic_getiter
name torch._dynamo.symbolic_convert.get_call_callable_depth
name torch._dynamo.symbolic_convert.get_node_source_info
name torch._dynamo.symbolic_convert.maybe_setup_comprehension_speculation
name torch._dynamo.symbolic_convert.raise_value_error
name torch._dynamo.symbolic_convert.unpack_iterable
name torch._dynamo.symbolic_convert.virtual_iterator_next
name torch._dynamo.trace_rules.BUILTIN_CALLABLES
name torch._dynamo.trace_rules.BUILTIN_INLINE_WHEN_CALLED
name torch._dynamo.trace_rules.DictBuiltinVariable
name torch._dynamo.trace_rules.GetAttrBuiltinVariable
name torch._dynamo.trace_rules.HasAttrBuiltinVariable
name torch._dynamo.trace_rules.IterBuiltinVariable
name torch._dynamo.trace_rules.ListBuiltinVariable
name torch._dynamo.trace_rules.SetAttrBuiltinVariable
name torch._dynamo.trace_rules.get_skip_reason
name torch._dynamo.utils.T1
name torch._dynamo.utils.T10
name torch._dynamo.utils.T2
name torch._dynamo.utils.T3
name torch._dynamo.utils.T4
name torch._dynamo.utils.T5
name torch._dynamo.utils.T6
name torch._dynamo.utils.T7
name torch._dynamo.utils.T8
name torch._dynamo.utils.T9
name torch._dynamo.utils.allow_lru_cache_wrapper_trace_without_warning
name torch._dynamo.utils.base_exception_methods
name torch._dynamo.utils.enumerate_items_with_dict_position
name torch._dynamo.utils.exception_methods
name torch._dynamo.utils.format_source_range
name torch._dynamo.utils.is_lru_cache_wrapper_trace_without_warning_allowed
name torch._dynamo.utils.is_pybind11_enum_member
name torch._dynamo.utils.is_safe_numpy_wrapper
name torch._dynamo.utils.is_torch_class
name torch._dynamo.utils.normalize_count_iter
name torch._dynamo.utils.numpy_wrapper_cache_key
name torch._dynamo.utils.object_delattr_ignore_descriptor
name torch._dynamo.utils.tracked_repr
name torch._dynamo.utils.unpack_and_apply_fn
name torch._dynamo.utils.unpack_iterable
name torch._dynamo.variables.AcceleratorDeviceIndexVariable
name torch._dynamo.variables.BaseBuiltinVariable
name torch._dynamo.variables.BaseUserFunctionVariable
name torch._dynamo.variables.BoundBuiltinMethodVariable
name torch._dynamo.variables.ClassMethodDescriptorVariable
name torch._dynamo.variables.ClassMethodVariable
name torch._dynamo.variables.CudaStreamVariable
name torch._dynamo.variables.CudagraphOverrideVariable
name torch._dynamo.variables.DequeVariable
name torch._dynamo.variables.DictBuiltinVariable
name torch._dynamo.variables.DictViewVariable
name torch._dynamo.variables.DunderDictVariable
name torch._dynamo.variables.GetAttrBuiltinVariable
name torch._dynamo.variables.GetSetDescriptorVariable
name torch._dynamo.variables.HasAttrBuiltinVariable
name torch._dynamo.variables.IterBuiltinVariable
name torch._dynamo.variables.ListBuiltinVariable
name torch._dynamo.variables.MemberDescriptorVariable
name torch._dynamo.variables.MethodDescriptorVariable
name torch._dynamo.variables.OrderedDictVariable
name torch._dynamo.variables.PropertyVariable
name torch._dynamo.variables.SetAttrBuiltinVariable
name torch._dynamo.variables.StaticMethodVariable
name torch._dynamo.variables.StructSequenceVariable
name torch._dynamo.variables.TritonSetAllocatorVariable
name torch._dynamo.variables.TupleGetterVariable
name torch._dynamo.variables.UserDefinedConstantVariable
name torch._dynamo.variables.UserDefinedVariable
name torch._dynamo.variables.WrapperDescriptorVariable
name torch._dynamo.variables.XPUDeviceVariable
name torch._dynamo.variables.get_device_context_manager
name torch._dynamo.variables.hashable
name torch._dynamo.variables.invoke_subgraph
name torch._dynamo.variables.object_protocol
name torch._dynamo.variables.register_device_context_manager
name torch._dynamo.variables.sets
name torch._flash_attention_forward_no_dropout_inplace
name torch._foreach_clone
name torch._foreach_mm
name torch._native
name torch._ops.OpOverloadPacket.op_overloads
name torch._philox_key_fold_in
name torch._philox_key_split
name torch._philox_normal_
name torch._philox_uniform_
name torch._subclasses.complex_tensor.WrapComplexMode
name torch._subclasses.fake_impls.embedding
name torch._subclasses.fake_impls.try_duck_specialization_first
name torch._subclasses.fake_impls.unique
name torch._subclasses.fake_tensor.FakeTensorConverter.clear_non_cpu_constants
name torch._subclasses.fake_tensor.FakeTensorDeviceMismatchError
name torch._subclasses.fake_tensor.OpaqueBase
name torch._subclasses.fake_tensor.TraceableWrapperSubclass
name torch._subclasses.fake_tensor._FAKE_TENSOR_CONSTRUCTOR_IGNORED_STATE_ATTRS
name torch._subclasses.fake_tensor._FakeTensorConstructorIgnoredState
name torch._subclasses.fake_tensor._is_indexed_device_type
name torch._subclasses.fake_tensor._is_privateuse1_backend_available
name torch._subclasses.meta_utils.IntLikeType
name torch._subclasses.meta_utils.OpaqueBase
name torch._tensor_iterator
name torch.accelerator.Graph
name torch.accelerator.empty_host_cache
name torch.accelerator.graphs
name torch.accelerator.memory.empty_host_cache
name torch.autograd.enforce_grad_layout_policy
name torch.autograd.function.BackwardCFunction.apply_boxed
name torch.autograd.grad_mode.enforce_grad_layout_policy
name torch.autograd.grad_mode.enforce_grad_layout_policy.clone
name torch.autograd.graph.region_activation_memory_budget
name torch.autograd.graph.set_override_stale_capture_stream
name torch.autograd.profiler_util.EventMetadata
name torch.autograd.profiler_util.EventMetadata.bandwidth_gb_s
name torch.autograd.profiler_util.EventMetadata.block
name torch.autograd.profiler_util.EventMetadata.blocks_per_sm
name torch.autograd.profiler_util.EventMetadata.bytes
name torch.autograd.profiler_util.EventMetadata.channel
name torch.autograd.profiler_util.EventMetadata.channel_type
name torch.autograd.profiler_util.EventMetadata.collective_name
name torch.autograd.profiler_util.EventMetadata.context
name torch.autograd.profiler_util.EventMetadata.dst_rank
name torch.autograd.profiler_util.EventMetadata.dtype
name torch.autograd.profiler_util.EventMetadata.est_occupancy_pct
name torch.autograd.profiler_util.EventMetadata.global_rank_start
name torch.autograd.profiler_util.EventMetadata.global_rank_stride
name torch.autograd.profiler_util.EventMetadata.graph_id
name torch.autograd.profiler_util.EventMetadata.graph_node_id
name torch.autograd.profiler_util.EventMetadata.grid
name torch.autograd.profiler_util.EventMetadata.group_ranks
name torch.autograd.profiler_util.EventMetadata.group_size
name torch.autograd.profiler_util.EventMetadata.in_msg_nelems
name torch.autograd.profiler_util.EventMetadata.in_split_size
name torch.autograd.profiler_util.EventMetadata.is_async
name torch.autograd.profiler_util.EventMetadata.occupancy
name torch.autograd.profiler_util.EventMetadata.out_msg_nelems
name torch.autograd.profiler_util.EventMetadata.out_split_size
name torch.autograd.profiler_util.EventMetadata.priority
name torch.autograd.profiler_util.EventMetadata.process_group_desc
name torch.autograd.profiler_util.EventMetadata.process_group_name
name torch.autograd.profiler_util.EventMetadata.queued
name torch.autograd.profiler_util.EventMetadata.rank
name torch.autograd.profiler_util.EventMetadata.registers_per_thread
name torch.autograd.profiler_util.EventMetadata.seq
name torch.autograd.profiler_util.EventMetadata.shared_memory
name torch.autograd.profiler_util.EventMetadata.src_rank
name torch.autograd.profiler_util.EventMetadata.stream
name torch.autograd.profiler_util.EventMetadata.warps_per_sm
name torch.autograd.profiler_util.FunctionEvent.metadata_json
name torch.backends.cuda.blas_workspace_size
name torch.backends.cuda.cublas_workspace_size
name torch.backends.cuda.cublaslt_workspace_size
name torch.backends.cuda.is_ck_sdpa_available
name torch.backends.cudnn.CudnnModule.depthwise_kernel
name torch.backends.cudnn.depthwise_kernel
name torch.backends.python_native
name torch.compiler.config.dynamic_values
name torch.compiler.get_default_backend
name torch.compiler.set_default_backend
name torch.cuda.current_solver_handle
name torch.cuda.graphs.CUDAGraph.get_graph_data
name torch.cuda.green_contexts.GreenContext.max_workqueue_concurrency
name torch.cuda.memory.caching_allocator_disabled
name torch.distributed.checkpoint.state_dict.HYBRID_SHARDING_STRATEGIES
name torch.distributed.device_mesh.IntLikeType
name torch.distributed.device_mesh.OpaqueBase
name torch.distributed.distributed_c10d.all_gather_single
name torch.distributed.distributed_c10d.record_comm
name torch.distributed.distributed_c10d.reduce_scatter_single
name torch.distributed.elastic.agent.server.health_check_server.HealthCheckServer.alive_callback
name torch.distributed.elastic.agent.server.local_elastic_agent.TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT
name torch.distributed.elastic.agent.server.local_elastic_agent.is_uninterruptible_state
name torch.distributed.elastic.agent.server.local_elastic_agent.justknobs_check
name torch.distributed.elastic.agent.server.local_elastic_agent.read_proc_state
name torch.distributed.elastic.utils.process_state
name torch.distributed.fsdp.DataParallelMeshDims
name torch.distributed.launcher.api.HealthCheckServer
name torch.distributed.launcher.api.LaunchConfig.shutdown_timeout
name torch.distributed.launcher.api.TORCHELASTIC_HEALTH_CHECK_PORT
name torch.distributed.launcher.api.create_healthcheck_server
name torch.distributed.launcher.api.justknobs_check
name torch.distributed.pipelining.microbatch.DTensor
name torch.distributed.pipelining.schedules.InferenceMode
name torch.distributed.pipelining.schedules.PipelineStage
name torch.distributed.pipelining.stage.DTensor
name torch.distributed.pipelining.stage.GetMeshCallback
name torch.distributed.pipelining.stage.InferenceMode
name torch.distributed.pipelining.stage.PipeliningMetadataError
name torch.distributed.pipelining.stage.TensorMeta
name torch.distributed.pipelining.stage.extract_tensor_meta
name torch.distributed.pipelining.stage.extract_tensor_metas
name torch.distributed.pipelining.stage.to_local_if_dtensor
name torch.distributed.pipelining.stage.validate_and_normalize_to_tuple
name torch.distributed.pipelining.stage.validate_static_arg_grad_correspondence
name torch.distributed.tensor.parallel.loss.Partial
name torch.distributed.tensor.placement_types.IntLikeType
name torch.distributed.tensor.placement_types.Partial.ALL_REDUCE_OPS
name torch.export.pt2_archive.constants.OPAQUE_OBJ_FILENAME_PREFIX
name torch.export.unflatten.is_opaque_value
name torch.func.rearrange
name torch.fx.config.do_not_emit_stack_traces
name torch.fx.experimental.dynamic_spec
name torch.fx.experimental.meta_tracer.Node
name torch.fx.experimental.meta_tracer.Proxy
name torch.fx.experimental.migrate_gradual_types.constraint_generator.BVar
name torch.fx.experimental.migrate_gradual_types.constraint_generator.Constraint
name torch.fx.experimental.migrate_gradual_types.constraint_generator.Graph
name torch.fx.experimental.migrate_gradual_types.transform_to_z3.Constraint
name torch.fx.experimental.migrate_gradual_types.transform_to_z3.Graph
name torch.fx.experimental.migrate_gradual_types.transform_to_z3.Node
name torch.fx.experimental.proxy_tensor.OpaqueBase
name torch.fx.experimental.proxy_tensor.ProxyTorchDispatchMode.enable_decompositions
name torch.fx.experimental.proxy_tensor.PythonKeyTracer.opaque_tracker
name torch.fx.experimental.proxy_tensor.PythonKeyTracer.torch_fn_metadata
name torch.fx.experimental.proxy_tensor.TraceableWrapperSubclass
name torch.fx.experimental.proxy_tensor.get_reconstruct_fn
name torch.fx.experimental.proxy_tensor.is_opaque_reference_type
name torch.fx.experimental.proxy_tensor.is_opaque_value_type
name torch.fx.experimental.proxy_tensor.should_hoist
name torch.fx.experimental.recording.ShapeEnv
name torch.fx.experimental.recording.TrackedFake
name torch.fx.experimental.schema_type_annotation.GraphModule
name torch.fx.experimental.schema_type_annotation.Proxy
name torch.fx.experimental.symbolic_shapes.AggressiveGuardFreeMode
name torch.fx.experimental.symbolic_shapes.OpaqueBase
name torch.fx.experimental.symbolic_shapes.ShapeEnv.error_on_new_guards
name torch.fx.experimental.symbolic_shapes.ShapeEnv.guarding_hint_or_throw
name torch.fx.experimental.symbolic_shapes.ShapeEnv.has_guarding_hint
name torch.fx.experimental.symbolic_shapes.ShapeEnv.optimization_hint
name torch.fx.experimental.symbolic_shapes.ShapeEnv.transfer_symbols_from_foreign_shape_env
name torch.fx.experimental.symbolic_shapes.StatefulSymbolicContext.excluded_sizes
name torch.fx.experimental.symbolic_shapes.StatelessSymbolicContext.unbacked_bounds
name torch.fx.experimental.symbolic_shapes.SubclassSymbolicContext.track_outer_size_stride
name torch.fx.experimental.symbolic_shapes.guarding_hint_or_throw
name torch.fx.experimental.symbolic_shapes.has_guarding_hint
name torch.fx.experimental.symbolic_shapes.is_gradtrackingtensor
name torch.fx.experimental.symbolic_shapes.optimization_hint
name torch.fx.experimental.symbolic_shapes.prefix_str
name torch.fx.experimental.unification.core.Var
name torch.fx.experimental.unification.match.Var
name torch.fx.experimental.unification.more.Var
name torch.fx.experimental.unification.utils.Var
name torch.fx.experimental.unify_refinements.Equality
name torch.fx.experimental.validator.ShapeEnv
name torch.fx.experimental.validator.TrackedFake
name torch.fx.graph.Graph.create_size_node
name torch.fx.graph.Graph.create_storage_offset_node
name torch.fx.graph.Graph.create_stride_node
name torch.fx.graph.Graph.materialize_symint
name torch.fx.graph.Graph.materialize_symints
name torch.fx.graph.TensorType
name torch.fx.graph.py_sym_types
name torch.fx.graph_module.Node
name torch.fx.graph_module.ShapeEnv
name torch.fx.graph_module.Tracer
name torch.fx.passes.dialect.common.cse_pass.Target
name torch.fx.passes.graph_manipulation.TensorMetadata
name torch.fx.passes.split_module.split_module_simple
name torch.fx.passes.split_utils.Subgraph
name torch.fx.tensor_type.DVar
name torch.fx.tensor_type.TensorType.dims
name torch.fx.traceback.MEMORY_BUDGET_ANNOTATION_KEY
name torch.library.Library.register_symm_mem_args
name torch.mps.load_metallib
name torch.nn.attention.flex_attention.BaseArgumentTypes
name torch.nn.attention.flex_attention.BlockMask.dq_kv_order
name torch.nn.attention.flex_attention.BlockMask.dq_kv_order_spt
name torch.nn.attention.flex_attention.BlockMask.dq_write_order
name torch.nn.attention.flex_attention.BlockMask.dq_write_order_full
name torch.nn.attention.flex_attention.TreeSpec
name torch.nn.attention.flex_attention.tree_flatten
name torch.nn.attention.flex_attention.tree_unflatten
name torch.nn.attention.varlen.flop_registry
name torch.nn.attention.varlen.torch
name torch.nn.attention.varlen.varlen_attn_out
name torch.nn.functional.LinearCrossEntropyOptions
name torch.nn.functional.linear_cross_entropy
name torch.nn.modules.LinearCrossEntropyLoss
name torch.nn.modules.LinearCrossEntropyOptions
name torch.nn.modules.linear_cross_entropy
name torch.nn.modules.linear_cross_entropy_options
name torch.nn.modules.loss.Linear
name torch.nn.modules.loss.LinearCrossEntropyLoss
name torch.nn.modules.loss.LinearCrossEntropyLoss.extra_repr
name torch.nn.modules.loss.LinearCrossEntropyLoss.forward
name torch.nn.modules.loss.LinearCrossEntropyLoss.ignore_index
name torch.nn.modules.loss.LinearCrossEntropyLoss.label_smoothing
name torch.nn.modules.loss.LinearCrossEntropyLoss.num_classes
name torch.nn.modules.loss.LinearCrossEntropyLoss.options
name torch.nn.modules.loss.LinearCrossEntropyLoss.out_features
name torch.nn.modules.loss.LinearCrossEntropyLoss.reduction
name torch.nn.modules.loss.LinearCrossEntropyOptions
name torch.nn.parallel.distributed.DistributedDataParallel.broadcast_buffers
name torch.nn.utils.parametrize.OpaqueBase
name torch.nn.utils.parametrize.is_opaque_reference_type
name torch.optim.adagrad.DeviceDict
name torch.optim.swap_in_optimizer_params_and_state
name torch.overrides.redispatch_function
name torch.profiler.profiler.ProfilerAction.DEVICE_STOPPED
name torch.random.WorkerInfo
name torch.random.thread_safe_generator
name torch.sparse.semi_structured.semi_sparse_clone
name torch.sparse.semi_structured.semi_sparse_to
name torch.sparse.semi_structured.semi_sparse_to_copy
name torch.thread_safe_generator
name torch.utils._python_dispatch.OpaqueBase
name torch.utils._python_dispatch.TraceableWrapperSubclass
name torch.utils._python_dispatch.TraceableWrapperSubclass.dim
name torch.utils._python_dispatch.TraceableWrapperSubclass.shape
name torch.utils._python_dispatch.TraceableWrapperSubclass.size
name torch.utils._python_dispatch.TraceableWrapperSubclass.storage_offset
name torch.utils._python_dispatch.TraceableWrapperSubclass.stride
name torch.utils._python_dispatch.TraceableWrapperSubclass.to
name torch.utils._python_dispatch._has_traceable_wrapper_subclass_protocol
name torch.utils._pytree.FlattenFn
name torch.utils._pytree.FlattenWithKeysFn
name torch.utils._pytree.UnflattenFn
name torch.utils._pytree._Asterisk
name torch.utils._pytree._asterisk
name torch.utils._pytree.log
name torch.utils.checkpoint.SavedTensor
name torch.utils.debug_log
name torch.xpu.clock_rate
name torch.xpu.device_memory_used
name torch.xpu.memory_usage
name torch.xpu.power_draw
name torch.xpu.temperature
name torch.xpu.utilization
param BlockMask(dq_kv_order)
param BlockMask(dq_kv_order_spt)
param BlockMask(dq_write_order)
param BlockMask(dq_write_order_full)
param CapabilityBasedPartitioner(skip_horizontal_fusion)
param CheckFunctionManager(cache_entries)
param ConvertFrame(recompile_limit)
param ConvertFrameAssert(recompile_limit)
param DistributedDataParallel(batched_grad_copy)
param DistributedDataParallel(forward_sync_buffers)
param DynamoGraphTransformer(graph_inputs)
param FunctionEvent(activity_type)
param FunctionEvent(external_id)
param FunctionEvent(extra_meta)
param FunctionEvent(flow_id)
param FunctionEvent(flow_start)
param FunctionEvent(flow_type)
param FunctionEvent(input_dtypes)
param FunctionEvent(is_python_function)
param FunctionEvent(linked_correlation_id)
param FunctionEvent(python_id)
param FunctionEvent(python_module_id)
param FunctionEvent(python_parent_id)
param FunctionEvent(structured_input_shapes)
param FunctionEvent(structured_input_strides)
param GroupNorm(bias)
param HigherOrderOperator(supports_training_input_mutation)
param InliningInstructionTranslator(allow_nested_graph_breaks)
param LocalElasticAgent(health_check_server)
param LocalElasticAgent(shutdown_timeout)
param LocalElasticAgent(uninterruptible_state_timeout)
param OptimizeContext(isolate_recompiles)
param OptimizeContext(shapes_spec)
param OutputGraphCommon(output_pycode)
param PipelineStage(get_mesh)
param PipelineStage(input_grads)
param PipelineStage(output_grads)
param ProxyTorchDispatchMode(decomposition_table)
param ScheduleDualPipeV(defer_pp_recv)
param ScheduleInterleaved1F1B(defer_pp_recv)
param ScheduleInterleavedZeroBubble(defer_pp_recv)
param ScheduleLoopedBFS(defer_pp_recv)
param ScheduleZBVZeroBubble(defer_pp_recv)
param SelectiveCheckpointContext(op_output)
param SideEffects(attr_mutation_kinds)
param SimpleElasticAgent(shutdown_timeout)
param SyncBatchNorm(bias)
param _TorchCompileAOTInductorWrapper(name)
param _TorchCompileInductorWrapper(name)
param __new__(fake_device)
param __new__(fake_mode_or_elem)
param __new__(requires_grad)
param _scaled_dot_product_attention_math_for_mps(enable_gqa)
param accumulate_grad(variable_grad)
param barrier(timeout)
param call_accumulate_grad(variable_grad)
param capture_begin(check_input_liveness)
param check(frame)
param check_verbose(frame)
param compile(isolate_recompiles)
param compile(name)
param compile(recompile_limit)
param compile(shapes_spec)
param compute_cache_size(cache_entries)
param compute_cache_size(total_cache_entries_all_regions)
param convert_frame(recompile_limit)
param convert_frame_assert(recompile_limit)
param create(workqueue_concurrency_limit)
param create(workqueue_scope)
param create_block_mask(compute_dq_write_order)
param create_block_mask(dq_kv_order)
param create_block_mask(separate_full_blocks)
param create_unspecified_symint_and_symbol(excluded_value)
param dynamo_graph_capture_for_export(fn)
param elastic_launch(health_check_server)
param export_chrome_trace(metadata)
param export_chrome_trace(use_python_export)
param flags(depthwise_kernel)
param from_dense(alg_id)
param from_kv_blocks(dq_kv_order)
param from_kv_blocks(dq_write_order)
param from_kv_blocks(dq_write_order_full)
param generate_output(repr_fn)
param get_and_maybe_log_recompilation_reasons(cache_entries)
param graph(check_input_liveness)
param graph(enable_annotations)
param insert_subgm(insertion_point)
param launch_agent(health_check_server)
param leaf_function(mutates_args)
param mark_unbacked(max)
param mark_unbacked(min)
param nested_compile_region(max_reuse_entries)
param nested_compile_region(reuse_hash_fn)
param new_group(sort_ranks)
param profile(activity_filters)
param split_group(backend)
param split_module(tuple_return)
param start_debug_server(fetch_timeout)
param step(loss_kwargs)
param tensorboard_trace_handler(use_python_export)
param to_sparse_semi_structured(alg_id)
param update_diff_guard_managers_for_existing_cache_entries(cache_entries)
param varlen_attn(block_table)
param varlen_attn(enable_gqa)
param varlen_attn(num_splits)
param varlen_attn(seqused_k)
"""

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "derive":
        raise SystemExit("usage: python tests/test_torch_floor.py derive OLD_TREE NEW_TREE")
    print("\n".join(derive(Path(sys.argv[2]), Path(sys.argv[3]))))
