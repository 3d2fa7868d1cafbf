"""Find the commit that made a benchmark slower, with ``git bisect``.

`bisect(repo, good, bad, measure)` is the core: ``measure(commit) -> ms``
(or a list of ms) is any callable. It checks the range (both commits exist,
GOOD is an ancestor of BAD, no bisection is already under way), confirms
that BAD is slower than GOOD beyond the threshold and the noise, then drives
``git bisect start --no-checkout`` (the user's working tree and HEAD are
never touched): at each commit git proposes, the candidate and GOOD are
measured in alternating rounds (`baseline.measure_rounds`) and compared
(`baseline.compare_samples`); a candidate that regressed is ``bad``, else
``good``; one whose measurement fails is skipped. ``git bisect reset`` runs
whatever happens.

`checkout_measure` turns "time the code of this checkout" into such a
callable: every commit gets a temporary ``git worktree`` (removed at the
end, even on errors) and the command runs there in a subprocess with
``PYTHONPATH=<checkout>/src``, so nothing is installed. `command_runner`
runs any command that prints a time in ms; `stellax_runner` runs
``stellax bench --case PATTERN`` of the checkout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .baseline import Verdict, compare_samples, measure_rounds

Measure = Callable[[str], "float | Sequence[float]"]


class BisectError(RuntimeError):
    """A bisection that cannot run or finish (the message says why and what to do)."""


class MeasureError(RuntimeError):
    """A measurement that failed at one commit (that commit is skipped)."""


@dataclasses.dataclass
class Step:
    commit: str
    verdict: Verdict | None  # None: the measurement failed (skipped)
    mark: str  # good | bad | skip
    note: str = ""


@dataclasses.dataclass
class BisectResult:
    good: str
    bad: str
    first_bad: str | None  # the first commit that regressed, None when none did
    subject: str
    message: str
    steps: list = dataclasses.field(default_factory=list)
    range_verdict: Verdict | None = None  # BAD against GOOD

    @property
    def found(self) -> bool:
        return self.first_bad is not None


def git(repo: str | os.PathLike, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``git -C repo ARGS``; with ``check``, a failure raises `BisectError` with git's message."""
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise BisectError(f"`git {' '.join(args)}` failed in {repo}: {detail[-1] if detail else proc.returncode}")
    return proc


def repo_root(path: str | os.PathLike | None = None) -> Path:
    """The top directory of the git repository at ``path`` (default: the current directory)."""
    where = Path(path) if path is not None else Path.cwd()
    if not where.is_dir():
        raise BisectError(f"--repo: {where} is not a directory")
    proc = git(where, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        raise BisectError(f"{where} is not inside a git repository (run from one, or pass --repo DIR)")
    return Path(proc.stdout.strip())


def resolve(repo: Path, rev: str, what: str) -> str:
    """The full commit id of ``rev``; `BisectError` naming ``what`` (GOOD/BAD) when it is not a commit."""
    proc = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise BisectError(f"{what} {rev!r} is not a commit of the repository {repo}")
    return proc.stdout.strip()


def subject(repo: Path, commit: str) -> str:
    """``<short id> <subject line>`` of a commit."""
    return git(repo, "log", "-1", "--format=%h %s", commit).stdout.strip()


def _git_path(repo: Path, name: str) -> Path:
    path = Path(git(repo, "rev-parse", "--git-path", name).stdout.strip())
    return path if path.is_absolute() else repo / path


def check_range(repo: Path, good: str, bad: str) -> tuple[str, str]:
    """Resolve GOOD and BAD and check they make a range to bisect; returns their full ids."""
    good_id, bad_id = resolve(repo, good, "GOOD"), resolve(repo, bad, "BAD")
    if good_id == bad_id:
        raise BisectError(f"GOOD {good!r} and BAD {bad!r} are the same commit; nothing to bisect")
    if git(repo, "merge-base", "--is-ancestor", good_id, bad_id, check=False).returncode != 0:
        raise BisectError(f"GOOD {good!r} is not an ancestor of BAD {bad!r}: bisection needs GOOD earlier on "
                          f"BAD's history (check the order of the two commits)")
    if _git_path(repo, "BISECT_START").exists():
        raise BisectError(f"a git bisect is already under way in {repo}; finish it with `git bisect reset` first")
    return good_id, bad_id


def bisect(repo: str | os.PathLike, good: str, bad: str, measure: Measure, *, threshold: float = 0.10,
           noise_k: float = 2.0, rounds: int = 3, label: str = "the benchmark",
           progress: Callable[[str], None] | None = None) -> BisectResult:
    """Name the first commit of GOOD..BAD whose ``measure`` regressed against GOOD's
    beyond ``threshold`` (relative) and the noise (see the module docstring)."""
    say = progress or (lambda text: None)
    root = repo_root(repo)
    good_id, bad_id = check_range(root, good, bad)

    def judge(commit: str) -> Verdict:
        names = (f"GOOD {good_id[:9]}", commit[:9])
        times = measure_rounds({names[0]: lambda: measure(good_id), names[1]: lambda: measure(commit)},
                               rounds=rounds, progress=progress)
        return compare_samples(times[names[0]], times[names[1]], threshold=threshold, noise_k=noise_k)

    say(f"measuring GOOD {subject(root, good_id)} against BAD {subject(root, bad_id)}")
    try:
        whole = judge(bad_id)
    except MeasureError as e:
        raise BisectError(f"cannot measure the range ends: {e}") from None
    say(f"BAD: {_describe(whole)}")
    if not whole.fails:
        return BisectResult(good, bad, None, "", f"no commit in {good}..{bad} regressed {label} beyond "
                            f"{100 * threshold:.0f}% (BAD: {_describe(whole)})", range_verdict=whole)
    steps: list[Step] = []
    try:
        out = git(root, "bisect", "start", "--no-checkout", bad_id, good_id).stdout
        while True:
            found = re.search(r"^([0-9a-f]{40}) is the first bad commit", out, re.M)
            if found:
                first = found.group(1)
                return BisectResult(good, bad, first, subject(root, first),
                                    f"first regressed commit: {subject(root, first)}", steps, whole)
            if "only 'skip'ped commits left" in out:
                left = re.findall(r"^([0-9a-f]{40})$", out, re.M)
                names = ", ".join(subject(root, c) for c in left) or "(see git)"
                return BisectResult(good, bad, None, "", f"the first regressed commit is one of {names} "
                                    f"(the commits between could not be measured)", steps, whole)
            candidate = git(root, "rev-parse", "BISECT_HEAD").stdout.strip()
            try:
                verdict = judge(candidate)
                mark, note = ("bad" if verdict.fails else "good"), _describe(verdict)
            except MeasureError as e:
                verdict, mark, note = None, "skip", f"measurement failed: {e}"
            steps.append(Step(candidate, verdict, mark, note))
            say(f"{mark:<4} {subject(root, candidate)}: {note}")
            proc = git(root, "bisect", mark, candidate, check=False)
            out = proc.stdout
            if proc.returncode != 0 and "only 'skip'ped commits left" not in out:
                detail = (proc.stderr or out).strip().splitlines()
                raise BisectError(f"`git bisect {mark} {candidate[:12]}` failed in {root}: "
                                  f"{detail[-1] if detail else proc.returncode}")
    finally:
        git(root, "bisect", "reset", check=False)


def _describe(v: Verdict) -> str:
    return (f"{v.current_ms:.4g} ms vs GOOD {v.baseline_ms:.4g} ms ({v.ratio:.2f}x, noise ±{v.noise_ms:.2g} ms, "
            f"{v.status})")


# -- measuring checkouts -----------------------------------------------------------
@contextlib.contextmanager
def checkout_measure(repo: str | os.PathLike, run: Callable[[Path, str], "float | Sequence[float]"]
                     ) -> Iterator[Measure]:
    """A ``measure(commit)`` that runs ``run(checkout_dir, commit)`` in a temporary
    worktree of the commit (one per commit, reused). Every worktree is removed on exit."""
    root = repo_root(repo)
    tmp = Path(tempfile.mkdtemp(prefix="stellax-bisect-"))
    trees: dict[str, Path] = {}

    def measure(commit: str):
        if commit not in trees:
            path = tmp / commit[:12]
            git(root, "worktree", "add", "--detach", str(path), commit)
            trees[commit] = path
        return run(trees[commit], commit)

    try:
        yield measure
    finally:
        for path in trees.values():
            git(root, "worktree", "remove", "--force", str(path), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        git(root, "worktree", "prune", check=False)


def _env(checkout: Path) -> dict:
    env = dict(os.environ)
    src = checkout / "src"
    env["PYTHONPATH"] = str(src if src.is_dir() else checkout)
    return env


def _run(argv: Sequence[str], checkout: Path, commit: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), cwd=checkout, env=_env(checkout), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MeasureError(f"{commit[:12]}: {' '.join(argv)} ran over {timeout:.0f} s") from None
    except OSError as e:
        raise MeasureError(f"{commit[:12]}: cannot run {argv[0]!r}: {e}") from None


def _tail(text: str, n: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def command_runner(command: Sequence[str], *, timeout: float = 600.0) -> Callable[[Path, str], float]:
    """Run ``command`` in the checkout (``PYTHONPATH=<checkout>/src``); the last number it prints
    on stdout is the time in ms."""
    def run(checkout: Path, commit: str) -> float:
        proc = _run(command, checkout, commit, timeout)
        if proc.returncode != 0:
            raise MeasureError(f"{commit[:12]}: {' '.join(command)} exited {proc.returncode}: {_tail(proc.stderr)}")
        numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", proc.stdout)
        if not numbers or float(numbers[-1]) <= 0:
            raise MeasureError(f"{commit[:12]}: {' '.join(command)} printed no positive time in ms "
                               f"(stdout: {_tail(proc.stdout) or 'empty'})")
        return float(numbers[-1])

    return run


def stellax_runner(case: str, suites: Sequence[str] = (), *, rounds: int = 3, min_time: float | None = None,
                   timer: str = "auto", timeout: float = 1800.0) -> Callable[[Path, str], float]:
    """Run ``stellax bench SUITES --case CASE`` of the checkout (no time budget); its time is the sum
    of the best times (``min_ms``) of the matching records. The first commit measured (GOOD) fixes
    the set of cases: later commits are timed on those cases only, and one that lacks any of them
    cannot be measured. A checkout whose CLI has no ``--case`` runs the suites whole and the
    records are filtered here."""
    pattern = re.compile(case)
    reference: dict[str, list[str]] = {}

    def run(checkout: Path, commit: str) -> float:
        with tempfile.TemporaryDirectory(prefix="stellax-bisect-run-") as tmp:
            out = Path(tmp) / "result.json"
            base = [sys.executable, "-m", "stellax.cli", "bench", *suites, "--json", str(out), "--quiet",
                    "--budget", "1e9", "--timer", timer]
            base += ["--min-time", str(min_time)] if min_time is not None else []
            proc = _run(base + ["--case", case, "--rounds", str(rounds)], checkout, commit, timeout)
            if proc.returncode == 2 and "unrecognized arguments" in proc.stderr:
                proc = _run(base, checkout, commit, timeout)  # an older CLI: filter the records here
            if proc.returncode != 0 or not out.is_file():
                raise MeasureError(f"{commit[:12]}: stellax bench exited {proc.returncode}: {_tail(proc.stderr)}")
            data = json.loads(out.read_text())
        ran = (data.get("environment") or {}).get("git_commit")
        if ran and not commit.startswith(ran):
            raise MeasureError(f"{commit[:12]}: the benchmark ran the stellax of commit {ran}, not the checkout's "
                               f"(is another stellax importable ahead of PYTHONPATH?)")
        records = [r for r in data.get("records", []) if pattern.search(r.get("key") or "")]
        timed = {r["key"]: float(r.get("min_ms") or r["median_ms"]) for r in records
                 if r.get("median_ms") and not r.get("error") and not r.get("skipped")}
        if not timed:
            why = (f"no record matches --case {case!r}" if not records else
                   f"the {len(records)} matching record(s) were not measured: "
                   + "; ".join(str(r.get("error") or r.get("skipped"))[:80] for r in records[:3]))
            raise MeasureError(f"{commit[:12]}: {why}")
        keys = reference.setdefault("keys", sorted(timed))
        missing = [k for k in keys if k not in timed]
        if missing:
            raise MeasureError(f"{commit[:12]}: {len(missing)} case(s) measured at the first commit were not "
                               f"measured here, e.g. {missing[0]!r}")
        return float(sum(timed[k] for k in keys))

    return run


__all__ = ["BisectError", "BisectResult", "MeasureError", "Step", "bisect", "check_range", "checkout_measure",
           "command_runner", "repo_root", "stellax_runner"]
