"""The README's first two commands stay true: CI (.ci/run) runs the README's test command exactly,
the install-and-demo command names real entry points and options, and the test extra pins what
the parity tests depend on."""

import os
import re
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def bash_blocks(markdown: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", markdown, re.S)]


def test_ci_runs_the_readme_test_command_exactly():
    test_command = next(b for b in bash_blocks(read("README.md")) if "pytest" in b)
    assert test_command == 'pip install -e ".[test]" && python -m pytest -q -n 2'
    ci_lines = [line.strip() for line in read(".ci/run").splitlines() if line.strip() and not line.startswith("#")]
    assert test_command in ci_lines
    assert not any("pip install" in line for line in ci_lines if line != test_command)  # nothing else installed


def test_readme_first_command_is_the_demo():
    first = bash_blocks(read("README.md"))[0]
    assert first == 'pip install -e . && ddtree-generate --prompt "def fibonacci(n):" --compare-ar'
    from ddtree_jax.cli.generate import build_parser

    args = build_parser().parse_args(["--prompt", "def fibonacci(n):", "--compare-ar"])
    assert args.target is None and args.compare_ar  # the embedded demo pair
    scripts = tomllib.loads(read("pyproject.toml"))["project"]["scripts"]
    assert scripts["ddtree-generate"] == "ddtree_jax.cli.generate:main"


def test_dependencies_pin_what_the_tests_compare_against():
    project = tomllib.loads(read("pyproject.toml"))["project"]
    extras = project["optional-dependencies"]
    assert "torch==2.13.0" in extras["test"] and "transformers==5.24.0" in extras["test"]
    assert any(d.startswith("ddtree-jax[") and "bench" in d for d in extras["test"])  # the bench.png test
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])  # only ddtree-bench plots
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    readme = read("README.md")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
