"""Training tokens/s by sequence length, from the JSON files of `stellax bench model train`.

    stellax bench model plot RESULTS.json [RESULTS.json ...] --out tokens.png

Reads the ``rows`` of every file (op ``model_train``, case ``"<family> seq=S batch=B"``, one row per
contender: ``stellax``, ``jax``, ``tokamax``), keeps the measured ones (a row with ``tokens_per_s``),
and draws one panel per model family: tokens/s against the sequence length (log scale), one line per
contender, each point labelled with its MFU (the row's ``pct_peak``). Files from several runs merge;
where two rows measure the same (family, sequence, contender) the later file wins. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_CASE = re.compile(r"^(?P<family>\w+) seq=(?P<seq>\d+) batch=(?P<batch>\d+)$")


def measured_points(rows) -> dict[str, dict[str, list[tuple[int, float, float | None]]]]:
    """``{family: {contender: [(seq, tokens_per_s, mfu_pct), ...]}}`` (sorted by ``seq``) of the
    measured ``model_train`` rows; later rows replace earlier ones of the same point."""
    points: dict[tuple[str, str, int], tuple[float, float | None]] = {}
    for row in rows:
        match = _CASE.match(str(row.get("case", "")))
        if row.get("op") != "model_train" or not match or not row.get("tokens_per_s"):
            continue
        key = (match["family"], str(row.get("contender")), int(match["seq"]))
        points[key] = (float(row["tokens_per_s"]), row.get("pct_peak"))
    out: dict[str, dict[str, list]] = {}
    for (family, contender, seq), (tps, mfu) in sorted(points.items()):
        out.setdefault(family, {}).setdefault(contender, []).append((seq, tps, mfu))
    return out


def load_rows(paths) -> list[dict]:
    """The ``rows`` of every file, in order; a file that is not a model benchmark's JSON raises
    ``ValueError`` naming it."""
    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{path}: expected the JSON of `stellax bench model train` (a 'rows' list)")
        rows += data["rows"]
    return rows


def plot(points, out: str | Path, title: str = "") -> Path:
    """Draw `measured_points` into the PNG ``out``: one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted(points)
    fig, axes = plt.subplots(1, len(families), figsize=(5.5 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for contender, series in sorted(points[family].items()):
            seqs = [p[0] for p in series]
            tps = [p[1] for p in series]
            ax.plot(seqs, tps, marker="o", label=contender)
            for seq, value, mfu in series:
                if mfu is not None:
                    ax.annotate(f"{mfu:.0f}% MFU", (seq, value), textcoords="offset points", xytext=(4, 4),
                                fontsize=8)
        ax.set_xscale("log", base=2)
        seqs = sorted({p[0] for series in points[family].values() for p in series})
        ax.set_xticks(seqs, [str(seq) for seq in seqs])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("training tokens/s")
        ax.set_title(f"{family}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None, prog: str = "stellax bench model plot") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="JSON files written by `stellax bench model train --out`")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="", help="a title above the panels (e.g. the device)")
    args = p.parse_args(argv)
    from .report import matplotlib_available

    ok, reason = matplotlib_available()
    if not ok:
        print(f"{prog}: {reason}", file=sys.stderr)
        return 2
    try:
        points = measured_points(load_rows(args.results))
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if not points:
        print(f"{prog}: no measured model_train rows (with tokens_per_s) in {', '.join(args.results)}",
              file=sys.stderr)
        return 1
    path = plot(points, args.out, args.title)
    counts = ", ".join(f"{family}: {sum(len(s) for s in by.values())} points" for family, by in points.items())
    print(f"wrote {path} ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
