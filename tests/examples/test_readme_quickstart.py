"""The README's "several workers, one copy" quick start, run as the README says: the code block saved as
``quickstart.py``, ``python quickstart.py --profile``, then ``torchrun --nproc-per-node 2 quickstart.py``."""

from __future__ import annotations

import re
from pathlib import Path

from tests.examples.conftest import REPO, VENV_BIN, free_port, run


def quickstart_source() -> str:
    """The README's Python block that follows the torchrun instructions (the one that profiles with --profile)."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("(`python quickstart.py --profile`)")
    block = re.search(r"```python\n(.*?)```", readme[start:], re.S)
    assert block is not None, "the README's quick start lost its code block"
    return block.group(1)


def test_the_readme_quick_start_profiles_then_two_ranks_share_one_copy(tmp_path: Path, env: dict[str, str]):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_source())
    profiled = run([str(VENV_BIN / "python"), str(script), "--profile"], timeout=120, cwd=tmp_path, env=env)
    said = re.search(r"saved the plan in quickstart-profile/ \((\d+) tensors stream\)", profiled.stdout)
    assert said is not None, profiled.stdout
    assert int(said.group(1)) > 0
    assert (tmp_path / "quickstart-profile" / "profile.json").is_file()

    proc = run([str(VENV_BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
                str(script)], timeout=180, cwd=tmp_path, env=env)
    lines = re.findall(r"rank (\d): (creator|follower), output sum (\S+), (\d+) offloaded tensors", proc.stdout)
    assert sorted(role for _, role, _, _ in lines) == ["creator", "follower"], proc.stdout
    assert len({total for _, _, total, _ in lines}) == 1, f"the ranks' outputs differ:\n{proc.stdout}"
    assert all(int(n) > 0 for _, _, _, n in lines)
