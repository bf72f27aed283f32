"""The layers point one way: the kernels (pallas_kernels/) import nothing of the models, the
speculative code, the engine or the converters; the models import nothing of the speculative
code, the engine or the CLIs; every import sits at the top of its module (none inside functions,
where an import cycle would hide)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree_jax", "pallas_kernels", "converters")
# package (or module prefix) -> prefixes it must never import
FORBIDDEN = {
    "pallas_kernels": ("ddtree_jax", "converters"),
    "ddtree_jax.models": ("ddtree_jax.speculative", "ddtree_jax.engine", "ddtree_jax.cli", "ddtree_jax.bench",
                          "ddtree_jax.training", "ddtree_jax.serve", "converters"),
    "ddtree_jax.speculative": ("ddtree_jax.engine", "ddtree_jax.cli", "ddtree_jax.bench", "ddtree_jax.serve",
                               "converters"),
    "ddtree_jax.engine": ("ddtree_jax.serve", "ddtree_jax.cli"),
    "ddtree_jax.serve": ("ddtree_jax.cli",),
}
# imports that may stay inside functions: optional or heavy dependencies loaded only by the feature
# that needs them; the CLIs import the engine lazily so --help and usage errors answer without JAX
LAZY_OK = {"matplotlib", "tqdm", "tokenizers", "triton", "torch", "transformers"}
LAZY_MODULES = ("ddtree_jax.cli.",)


def _modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path


def _imports(tree: ast.AST, package: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield node, f"{base}.{node.module}" if node.module else base
            else:
                yield node, node.module or ""


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_point_one_way_and_sit_at_the_top(name, path):
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    top |= {id(c) for n in tree.body if isinstance(n, (ast.Try, ast.If)) for c in ast.walk(n)}
    problems = []
    for node, target in _imports(tree, package):
        for layer, banned in FORBIDDEN.items():
            if (name == layer or name.startswith(layer + ".")) and any(
                    target == b or target.startswith(b + ".") for b in banned):
                problems.append(f"line {node.lineno}: {name} imports {target} (an upward import)")
        if id(node) not in top and target.split(".")[0] not in LAZY_OK and not name.startswith(LAZY_MODULES):
            problems.append(f"line {node.lineno}: import of {target} inside a function")
    assert not problems, "\n".join(problems)


KERNEL_MODULES = sorted(p.stem for p in (ROOT / "pallas_kernels").glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_every_kernel_sits_next_to_its_reference(name):
    """Each kernel file's public entry points take `impl=` and the file holds their pure-jnp
    reference, named one way: `reference` (one kernel in the file) or `<kernel>_reference`."""
    import importlib
    import inspect

    module = importlib.import_module(f"pallas_kernels.{name}")
    entries = [f for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__
               and not n.startswith("_") and "impl" in inspect.signature(f).parameters]
    assert entries, f"pallas_kernels.{name} has no entry point taking impl="
    refs = {n for n, f in vars(module).items()
            if inspect.isfunction(f) and (n == "reference" or n.endswith("_reference"))}
    for f in entries:
        assert "reference" in refs or f"{f.__name__}_reference" in refs, (name, f.__name__, refs)
