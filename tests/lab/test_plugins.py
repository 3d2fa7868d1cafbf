"""Promotion and plugins: `stellax lab promote` writes a package whose
implementation, found through STELLAX_PLUGIN_PATH or the
``stellax.implementations`` entry-point group, takes part in dispatch and in
the checks; a broken plugin is listed and skipped, never breaks the import."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stellax.lab import cli, template
from stellax.lab.archive import Archive
from stellax.lab.candidate import find_op, source_hash
from stellax.lab.errors import LabError

NO_BENCH = {"dtypes": ["float32"], "max_examples": 1, "benchmark": False}

PROBE = textwrap.dedent('''
    import json, sys
    import jax, jax.numpy as jnp
    import stellax
    from stellax.core import observe_calls
    from stellax.lab.plugins import broken_plugins, info_lines, load_plugins, loaded_plugins
    from stellax.testing import check_op
    added = list(loaded_plugins().values())  # `import stellax` loaded them
    op = stellax.registered_ops()["hadamard_transform"]
    seen = []
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 64), jnp.float32)
    with observe_calls(lambda o, impl, call, cfg: seen.append(impl.name)):
        y = op(x, None, block=64)
    checks = check_op(op, implementations=[n for n in op.implementations if n.startswith(("lab_", "ep_"))],
                      dtypes=[jnp.float32])
    print(json.dumps({"added": added, "order": list(op.implementations), "dispatched": seen,
                      "checks": [[c.implementation, c.passed] for c in checks], "broken": broken_plugins(),
                      "info": info_lines(), "again": load_plugins()}))
''')


def _probe(env_extra):
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_promote_then_discover(tmp_path, worker, capsys):
    op = find_op("hadamard_transform")
    source = template.implementation_template(op)
    archive_path = tmp_path / "lab.sqlite"
    with Archive(archive_path) as archive:
        archive.start_run("p", op.name, "mutate", {})
        cid = archive.add_candidate("p", source, source_hash(source), parent_id=None, generation=0, proposer="seed")
        with pytest.raises(LabError, match="never finished"):
            from stellax.lab.promote import promote
            promote(archive, cid, tmp_path)
        archive.finish_candidate(cid, worker.evaluate(source, op.name, options=NO_BENCH))
        bad = archive.add_candidate("p", "X = 1\n", source_hash("X = 1\n"), parent_id=None, generation=1,
                                    proposer="mutate")
        archive.finish_candidate(bad, worker.evaluate("X = 1\n", op.name, options=NO_BENCH))
    assert cli.main(["promote", str(bad), "--archive", str(archive_path), "--out", str(tmp_path / "plugins")]) == 2
    assert "did not pass (first failure: load)" in capsys.readouterr().err
    assert cli.main(["promote", str(cid), "--archive", str(archive_path), "--out", str(tmp_path / "plugins")]) == 0
    package = tmp_path / "plugins" / f"stellax-lab-hadamard-transform-{cid}"
    assert (package / "pyproject.toml").read_text().count('[project.entry-points."stellax.implementations"]') == 1
    name = f"lab_hadamard_transform_{cid}"

    broken_dir = tmp_path / "more"
    broken_dir.mkdir()
    (broken_dir / "broken_plugin.py").write_text("raise RuntimeError('this plugin is broken on purpose')\n")
    (broken_dir / "no_op.py").write_text("X = 1\n")

    site = tmp_path / "site"
    (site / "ep_demo-0.1.dist-info").mkdir(parents=True)
    (site / "ep_demo-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-demo\nVersion: 0.1\n")
    (site / "ep_demo-0.1.dist-info" / "entry_points.txt").write_text(
        "[stellax.implementations]\nep_hadamard = ep_hadamard_plugin\n")
    (site / "ep_hadamard_plugin.py").write_text(
        source.replace("name='candidate'", "name='ep_hadamard'") + 'POSITION = "last"\n')

    result = _probe({"STELLAX_PLUGIN_PATH": os.pathsep.join([str(package), str(broken_dir), str(tmp_path / "nope")]),
                     "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    assert sorted(result["added"]) == sorted([f"hadamard_transform/{name}", "hadamard_transform/ep_hadamard"])
    assert result["order"][0] == name and result["order"][-1] == "ep_hadamard"
    assert result["dispatched"] == [name]  # the promoted implementation is the default now
    assert sorted(result["checks"]) == sorted([[name, True]] * 4 + [["ep_hadamard", True]] * 4)
    broken = result["broken"]
    assert "this plugin is broken on purpose" in broken[str(broken_dir / "broken_plugin.py")]
    assert "defines no OP" in broken[str(broken_dir / "no_op.py")]
    assert any("nope" in k and "no such file" in v for k, v in broken.items())
    assert any(line.startswith("broken plugin") for line in result["info"])
    assert result["again"] == []  # loading twice registers nothing twice
