"""`stellax lab report`: a search's markdown report and its PNG (best score
per generation, and the winner's lineage)."""

from __future__ import annotations

import os
from pathlib import Path

from .archive import Archive, iter_generations
from .errors import LabError


def _run_id(archive: Archive, run_id: str | None) -> str:
    runs = archive.runs()
    if not runs:
        raise LabError(f"archive {archive.path}: no search runs yet (stellax lab search ... first)")
    if run_id is None:
        return runs[-1]["id"]
    if archive.run(run_id) is None:
        raise LabError(f"--run {run_id}: not in {archive.path}; runs: {[r['id'] for r in runs]}")
    return run_id


def generation_table(archive: Archive, run_id: str) -> list[dict]:
    """Per generation: candidates, passed, best score in it and best so far."""
    rows, best = [], None
    for g, cands in iter_generations(archive.evaluated(run_id)):
        top = max(c["score"] for c in cands)
        best = top if best is None else max(best, top)
        rows.append({"generation": g, "candidates": len(cands), "passed": sum(c["passed"] for c in cands),
                     "best": top, "best_so_far": best})
    return rows


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def markdown(archive: Archive, run_id: str) -> str:
    run = archive.run(run_id)
    done = archive.evaluated(run_id)
    best = archive.best(run_id)
    lines = [f"# stellax lab: run `{run_id}`", "",
             f"op `{run['op']}`, proposer `{run['proposer']}`, {len(done)} evaluations, archive `{archive.path}`.", ""]
    if best is not None:
        bench = best["report"].get("benchmark") or {}
        lines += [f"**Winner: candidate #{best['id']}** ({best['note'] or best['proposer']}): "
                  f"{best['report']['status']}, score {best['score']:.4f}, speedup "
                  f"{_fmt(best['speedup'])}x vs `{bench.get('baseline')}`.", ""]
    lines += ["## Best score per generation", "", "| generation | candidates | passed | best | best so far |",
              "|---:|---:|---:|---:|---:|"]
    for r in generation_table(archive, run_id):
        lines.append(f"| {r['generation']} | {r['candidates']} | {r['passed']} | {r['best']:.4f} | "
                     f"{r['best_so_far']:.4f} |")
    if best is not None:
        lines += ["", "## The winner's lineage", "", "| id | generation | proposer | change | status | speedup | score |",
                  "|---:|---:|---|---|---|---:|---:|"]
        for c in archive.lineage(best["id"]):
            lines.append(f"| {c['id']} | {c['generation']} | {c['proposer']} | {c['note'] or ''} | "
                         f"{c['report']['status'] if c['report'] else c['status']} | {_fmt(c['speedup'])} | "
                         f"{_fmt(c['score'], '.4f')} |")
    lines += ["", "## Every candidate", "", "| id | parent | proposer | change | status | first failure | speedup | score |",
              "|---:|---:|---|---|---|---|---:|---:|"]
    for c in done:
        lines.append(f"| {c['id']} | {c['parent_id'] or ''} | {c['proposer']} | {c['note'] or ''} | "
                     f"{c['report']['status']} | {c['first_failure'] or ''} | {_fmt(c['speedup'])} | {c['score']:.4f} |")
    attempts = archive.attempts(run_id)
    if attempts:
        lines += ["", f"{len(attempts)} proposals did not yield a candidate: "
                  + ", ".join(sorted({a['kind'] for a in attempts})) + "."]
    return "\n".join(lines) + "\n"


def plot(archive: Archive, run_id: str, path: Path) -> Path:
    """Best score per generation (and best so far) and the winner's lineage scores."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    table = generation_table(archive, run_id)
    best = archive.best(run_id)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    gens = [r["generation"] for r in table]
    a.plot(gens, [r["best"] for r in table], "o", label="best in generation")
    a.step(gens, [r["best_so_far"] for r in table], where="post", label="best so far")
    a.axhline(2.0, color="grey", lw=0.8, ls="--", label="matches the baseline (score 2)")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_xlabel("generation")
    a.set_ylabel("score (1 + speedup if correct)")
    a.legend(fontsize=7)
    a.set_title(f"{archive.run(run_id)['op']}: {run_id}", fontsize=9)
    if best is not None:
        chain = archive.lineage(best["id"])
        b.plot(range(len(chain)), [c["score"] or 0 for c in chain], "-o")
        b.set_xticks(range(len(chain)), [f"#{c['id']}" for c in chain], fontsize=7)
        b.set_title("winner's lineage (root → winner)", fontsize=9)
        b.set_ylabel("score")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(archive: Archive, run_id: str | None, out: str | os.PathLike) -> list[Path]:
    """Write ``report.md`` and ``report.png`` for a run into ``out``."""
    run_id = _run_id(archive, run_id)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(markdown(archive, run_id))
    return [md, plot(archive, run_id, out / "report.png")]
