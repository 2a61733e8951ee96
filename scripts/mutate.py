"""Mutation check: does the suite catch the mistakes it claims to?

Each mutation below is a deliberate mistake, written as text replacements in
one source file. The script copies the repository to a scratch directory,
checks that the selected tests pass there unmutated, then applies one
mutation at a time, runs the tests chosen for it and reports the mutation
*killed* (some test failed) or *survived* (every test passed: the suite
misses that mistake). Exit status 0 only when every mutation was killed.

An anchor that is not found exactly once stops the script with an error, so a
refactor cannot silently disable a mutation: update the anchor here instead.
Add a mutation with each feature (one entry in ``MUTATIONS``).

Usage::

    python scripts/mutate.py               # every mutation (``make mutate``)
    python scripts/mutate.py -k module     # those whose name contains "module"
    python scripts/mutate.py --list        # names, files and tests, nothing run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    """``edits`` are ``(anchor, replacement)`` pairs applied to ``path`` (relative to the
    repository); each anchor must occur exactly once. ``tests`` are pytest arguments."""

    name: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


def _drop_module_argument(argument: str) -> Mutation:
    line = {
        "linear_bias": "            linear_bias=self.bias,\n",
        "weight": "            weight=self.class_weight,\n",
        "label_smoothing": "            label_smoothing=self.label_smoothing,\n",
        "reduction": "            reduction=self.reduction,\n",
        "options": "            options=self.options,\n",
        "ignore_index": "            ignore_index=self.ignore_index,\n",
        "z_loss": "            z_loss=self.z_loss,\n",
        "softcap": "            softcap=self.softcap,\n",
        "extras": "            **extras,\n",
    }[argument]
    return Mutation(
        f"module forward drops {argument}=",
        "src/linear_ce/module.py",
        ((line, ""),),
        ("tests/test_module.py",),
    )


MUTATIONS: tuple[Mutation, ...] = (
    *(
        _drop_module_argument(a)
        for a in (
            "linear_bias",
            "weight",
            "label_smoothing",
            "reduction",
            "options",
            "ignore_index",
            "z_loss",
            "softcap",
            "extras",
        )
    ),
    Mutation(
        "reference z-loss rows without class and ignore weighting",
        "src/linear_ce/reference.py",
        (
            (
                "z_rows = torch.where(row_weight != 0, call.z_loss * row_weight * lse.square(), 0.0)",
                "z_rows = call.z_loss * lse.square()",
            ),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    Mutation(
        "reference ignores token weights",
        "src/linear_ce/reference.py",
        (
            (
                "per_row, z_rows = per_row * token_weight, z_rows * token_weight",
                "per_row, z_rows = per_row * token_weight.mean(), z_rows * token_weight.mean()",
            ),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    Mutation(
        "reference lse of the logits before the transform",
        "src/linear_ce/reference.py",
        (
            (
                "    logits = transform.plain(logits)\n",
                "    raw, logits = logits, transform.plain(logits)\n",
            ),
            ("lse = torch.logsumexp(logits, dim=1)", "lse = torch.logsumexp(raw, dim=1)"),
        ),
        ("tests/test_combinations.py", "-k", "reference"),
    ),
    # The chunk loop and its heads are young; keep their mutations few and their anchors short.
    Mutation(
        "cross-entropy head weights every K-dim position with position 0's token weight",
        "src/linear_ce/losses/cross_entropy.py",
        (
            ("loss * terms.token[rows, p]", "loss * terms.token[rows, 0]"),
            ("r = terms.scale[rows, p] * factor", "r = terms.scale[rows, 0] * factor"),
        ),
        ("tests/test_combinations.py", "-k", "chunked and kdim"),
    ),
    Mutation(
        "mean denominator includes the token weights",
        "src/linear_ce/losses/cross_entropy.py",
        (("        total = omega.sum()\n", "        total = (omega * token).sum()\n"),),
        ("tests/test_combinations.py", "-k", "chunked and mean"),
    ),
    Mutation(
        "temperature forgotten without a softcap",
        "src/linear_ce/engine/transform.py",
        (
            (
                "            if self.temperature != 1.0:\n                logits.div_(self.temperature)\n            return",
                "            return",
            ),
        ),
        ("tests/test_combinations.py", "-k", "chunked and temperature"),
    ),
    Mutation(
        "capability check always answers False",
        "src/linear_ce/engine/capability.py",
        (
            (
                "    return any(flag in _cpu_flags() for flag in _CPU_FLAGS[dtype])",
                "    return False",
            ),
        ),
        ("tests/test_capability.py",),
    ),
    Mutation(
        'one chunk for reduction="none"',
        "src/linear_ce/ops/cross_entropy.py",
        (
            (
                "    grads = run_head(\n        call.input,",
                '    if call.reduction == "none":\n'
                "        options = LinearCrossEntropyOptions(chunking_method=None)\n"
                "    grads = run_head(\n        call.input,",
            ),
        ),
        ("tests/test_memory_bounds.py", "-k", "none"),
    ),
    Mutation(
        "an fp32 copy of the weight on the native half path",
        "src/linear_ce/engine/gemm.py",
        (
            (
                'half tile from :meth:`half_tile_buffer`."""\n        torch.mm(x, weight.T, out=out)',
                'half tile from :meth:`half_tile_buffer`."""\n'
                "        out.copy_(torch.mm(x.float(), weight.T.float()))",
            ),
        ),
        ("tests/test_memory_bounds.py", "-k", "bf16-mean and not upcast"),
    ),
    Mutation(
        "sequence objective: the loop cuts its own chunks (groups split)",
        "src/linear_ce/ops/sequence_objective.py",
        (("        chunks=[[c.rows for c in chunks]],\n", ""),),
        ("tests/test_sequence_objective.py", "-k", "whole_groups"),
    ),
    Mutation(
        'sequence objective: group="pairs" pairs neighbouring rows',
        "src/linear_ce/engine/sequence_layout.py",
        (
            (
                "        return torch.arange(sequences) % max(sequences // 2, 1)",
                "        return torch.arange(sequences) // 2",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "dpo-sigmoid and float64"),
    ),
    Mutation(
        "sequence objective: a shift scores across packed sequences",
        "src/linear_ce/engine/sequence_layout.py",
        (("        scored &= same\n", ""),),
        ("tests/test_sequence_objective.py", "-k", "random_packed"),
    ),
    Mutation(
        "sequence objective: the four-GEMM path drops the entropy's gradient",
        "src/linear_ce/ops/sequence_objective.py",
        (
            (
                "target, layout.valid, spec.vocab.start, head.row_stats, per_row(g), per_row(h)",
                "target, layout.valid, spec.vocab.start, head.row_stats, per_row(g), None",
            ),
        ),
        ("tests/test_sequence_objective.py", "-k", "plain_formula and four_gemm"),
    ),
    Mutation(
        "objectives: IPO without length normalisation",
        "src/linear_ce/objectives.py",
        (
            (
                "            return (phi_c / len_c - phi_r / len_r - 1 / (2 * beta)) ** 2",
                "            return (phi_c - phi_r - 1 / (2 * beta)) ** 2",
            ),
        ),
        ("tests/test_objectives_builtin.py", "-k", "dpo-ipo"),
    ),
)


def _apply(text: str, mutation: Mutation) -> str:
    for anchor, replacement in mutation.edits:
        count = text.count(anchor)
        if count != 1:
            raise SystemExit(
                f"mutate.py: anchor of {mutation.name!r} occurs {count} times in "
                f"{mutation.path} (expected once); update MUTATIONS in scripts/mutate.py:\n"
                f"{anchor}"
            )
        text = text.replace(anchor, replacement)
    return text


def _pytest(scratch: Path, args: tuple[str, ...]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "--tb=line", "-p", "no:cacheprovider", *args],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    # With --tb=line a failure is one "path:line: message" line: show the first.
    failure = next((line for line in lines if line.startswith(str(scratch))), "")
    summary = lines[-1] if lines else ""
    return done.returncode, f"{summary}; {failure[:300]}" if failure else summary


def _copy(scratch: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "bench-out"
    )
    shutil.copytree(REPO, scratch, ignore=ignore, dirs_exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    where = subprocess.run(
        [sys.executable, "-c", "import linear_ce; print(linear_ce.__file__)"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"mutate.py: the scratch copy imports linear_ce from {where}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="pattern", default="", help="only mutations whose name has this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the tests"
    )
    options = parser.parse_args()
    chosen = [m for m in MUTATIONS if options.pattern in m.name]
    for mutation in chosen:  # every anchor is checked before anything runs
        _apply((REPO / mutation.path).read_text(), mutation)
    if options.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}; pytest {' '.join(m.tests)}")
        return 0

    with tempfile.TemporaryDirectory(prefix="linear_ce-mutate-") as tmp:
        scratch = Path(tmp)
        _copy(scratch)
        if not options.no_baseline:
            for tests in dict.fromkeys(m.tests for m in chosen):
                status, summary = _pytest(scratch, tests)
                if status != 0:
                    print(f"baseline fails: pytest {' '.join(tests)}: {summary}")
                    return 2
        results = []
        for mutation in chosen:
            target = scratch / mutation.path
            original = target.read_text()
            target.write_text(_apply(original, mutation))
            start = time.monotonic()
            try:
                status, summary = _pytest(scratch, mutation.tests)
            finally:
                target.write_text(original)
            verdict = {0: "SURVIVED", 1: "killed"}.get(status, f"error (pytest exit {status})")
            results.append((mutation, verdict))
            print(
                f"{verdict:>8}  {mutation.name}  ({time.monotonic() - start:.0f} s: {summary})",
                flush=True,
            )
    survived = [m.name for m, verdict in results if verdict != "killed"]
    print(f"\n{len(results) - len(survived)} of {len(results)} mutations killed")
    for name in survived:
        print(f"not killed: {name}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
