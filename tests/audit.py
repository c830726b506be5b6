"""`make audit`: pip-audit over the runtime requirements and everything they pull in, as installed here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
AUDIT_TIMEOUT_S = 300


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def runtime_closure(requirements: Path) -> dict[str, str]:
    """name -> installed version for the listed packages and, through their metadata, all they depend on."""
    versions: dict[str, str] = {}
    expanded: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(line) for line in requirement_lines(requirements)]
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in expanded:
            continue
        expanded.add((name, extras))
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            print(f"warning: {req.name} is not installed here, so it is not audited; run make install", file=sys.stderr)
            continue
        versions[name] = dist.version
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append(child)
    return versions


def audit(pins: dict[str, str], report: Path, ignore: list[str]) -> int:
    report.parent.mkdir(parents=True, exist_ok=True)
    report.unlink(missing_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    argv = [sys.executable, "-m", "pip_audit", "--requirement", f.name, "--no-deps", "--disable-pip",
            "--format", "json", "--output", str(report), "--progress-spinner", "off",
            *(arg for vuln in ignore for arg in ("--ignore-vuln", vuln))]
    try:
        proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S)
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    except subprocess.TimeoutExpired:
        detail = [f"no answer within {AUDIT_TIMEOUT_S} s"]
    finally:
        Path(f.name).unlink()
    try:
        result = json.loads(report.read_text())
    except (OSError, ValueError):
        print(f"WARNING: pip-audit could not reach its vulnerability service ({detail[0]}); runtime dependencies "
              "were NOT audited. Run `make audit` again where PyPI's JSON API is reachable.", file=sys.stderr)
        return 0
    return verdict(result, len(pins))


def verdict(result: dict, total: int) -> int:
    deps = result.get("dependencies", [])
    vulnerable = [d for d in deps if d.get("vulns")]
    skipped = [d for d in deps if d.get("skip_reason")]
    for dep in vulnerable:
        for vuln in dep["vulns"]:
            fixes = ", ".join(vuln.get("fix_versions") or []) or "no fixed version yet"
            print(f"VULNERABLE: {dep['name']} {dep['version']}: {vuln['id']} (fixed in: {fixes})", file=sys.stderr)
    if skipped:
        print(f"WARNING: {len(skipped)} of {total} runtime packages could not be audited (the vulnerability service "
              f"has no record of them or could not be reached), e.g. {skipped[0]['name']}: "
              f"{skipped[0]['skip_reason']}", file=sys.stderr)
    if vulnerable:
        print(f"pip-audit: {len(vulnerable)} runtime package(s) with known vulnerabilities: bump the pin in "
              "requirements.txt, or add the id to AUDIT_IGNORE in the Makefile with the reason.", file=sys.stderr)
        return 1
    print(f"pip-audit: no known vulnerabilities in {total - len(skipped)} audited runtime packages.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requirements", type=Path, default=ROOT / "requirements.txt")
    parser.add_argument("--report", type=Path, default=ROOT / "test-artifacts" / "pip-audit.json")
    parser.add_argument("--ignore-vuln", action="append", default=[], metavar="ID")
    args = parser.parse_args(argv)
    pins = runtime_closure(args.requirements)
    print(f"pip-audit: {len(pins)} runtime packages from {args.requirements.name} and their dependencies")
    return audit(pins, args.report, args.ignore_vuln)


if __name__ == "__main__":
    sys.exit(main())
